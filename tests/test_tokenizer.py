"""Tokenizers against independent references, the registry, padding, bad tokenizer files, and the package's
place below data/, training/ and convert/."""

import ast
import json
import pathlib
import random

import numpy
import pytest
import regex
from conftest_data import ReferenceGPT2BPE, data_assets
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

import megatron_patch.tokenizer
from megatron_patch.tokenizer import (
    TOKENIZERS,
    TokenizerFileError,
    build_tokenizer,
    gpt2,
    load_tokenizers,
    padded_vocab_size,
    tokenizer_names,
)
from megatron_patch.tokenizer.registry import BUILTIN_TOKENIZERS


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return data_assets(tmp_path_factory)


def test_gpt2_bpe_equals_reference_implementation(assets):
    options = assets.options["GPT2BPETokenizer"]
    tok = build_tokenizer("GPT2BPETokenizer", **options)
    reference = ReferenceGPT2BPE(options["vocab_file"], options["merge_file"])
    expected = [reference.encode(text) for text in assets.texts]
    assert [tok.tokenize(text) for text in assets.texts] == expected
    assert tok.tokenize_batch(assets.texts) == expected
    assert tok.eod == reference.vocab["<|endoftext|>"] and tok.vocab_size == len(reference.vocab)
    assert tok.detokenize(expected[-1]) == assets.texts[-1]


# Text where GPT-2's pre-tokenizer has corner cases: contractions (lower case only, a quote alone),
# whitespace runs (the last space goes to the next word, other whitespace stays in its run),
# every kind of newline and Unicode space, digits of several scripts, letters made of several code
# points, emoji sequences, control characters, and text with no pre-token at all.
ADVERSARIAL_TEXTS = [
    "it's 'S 't 're 've 'm 'll 'd don't ''s ' s I'M y'all 'sup rock'n'roll '",
    "x" + " " * 1000 + "y" + "\t" * 300 + "\n" * 200 + " \t \n " * 100 + "z   ",
    "  \n\n \t \r\n\r\n\r  end  \n",
    "a\rb\r\nc\nd\x0be\x0cf\x85g\u2028h\u2029i\u3000j\xa0k\u1680l\u180em\u200bn\u202fo\u205fp",
    "\x00\x01\x1c\x1d\x1e\x1f\x7f\ufeff\ufffd mixed \x1c \x1fx",
    "1234567890123 3.14159 1e-9 0x1F -42 ٣٤٥ ²³ ½ Ⅻ 一二 𝟘𝟙 9a a9",
    "😀👍🏽 👨\u200d👩\u200d👧 🇫🇷 ❤\ufe0f e\u0301 é",
    "Ελληνικά русский עִבְרִית العربية हिन्दी 한국어 ไทย 𑼄",
    "!!! ...  ,,, ;; -- __init__ self._x=1;  \"q\" `b` <|endoftext|> [CLS] \\n",
    "",
    " ",
    "\n",
    "'",
]


def _plain_tokenizers_gpt2(options):
    """The GPT-2 BPE as `tokenizers` runs it on its own: its ByteLevel pre-tokenizer splits the text."""
    plain = HFTokenizer(models.BPE.from_file(options["vocab_file"], options["merge_file"]))
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return plain


def test_gpt2_bpe_equals_plain_tokenizers_and_reference_on_adversarial_text(assets, monkeypatch):
    options = assets.options["GPT2BPETokenizer"]
    texts = assets.texts + ADVERSARIAL_TEXTS
    reference = ReferenceGPT2BPE(options["vocab_file"], options["merge_file"])
    expected = [reference.encode(text) for text in texts]
    plain = _plain_tokenizers_gpt2(options)
    assert [e.ids for e in plain.encode_batch(texts, add_special_tokens=False)] == expected
    # Cold and warm cache, one batch and one text at a time, and a cache so small it is cleared.
    tok = build_tokenizer("GPT2BPETokenizer", **options)
    assert tok.tokenize_batch(texts) == expected
    assert [tok.tokenize(text) for text in reversed(texts)] == expected[::-1]
    monkeypatch.setattr(gpt2, "CACHE_SIZE", 50)
    for i in range(0, len(texts), 7):
        assert tok.tokenize_batch(texts[i : i + 7]) == expected[i : i + 7]
        batch_pieces = {piece for text in texts[i : i + 7] for piece in reference.PATTERN.findall(text)}
        assert len(tok._cache) <= max(50, len(batch_pieces))
    # A letter newer than the Unicode tables of `tokenizers`' regex engine, which splits it off as
    # a symbol; the `regex` package, which Megatron-LM uses, knows it.
    newer = "a\u0c5cb \u0c5c1"
    assert regex.fullmatch(r"\p{L}", "\u0c5c") and tok.tokenize(newer) == reference.encode(newer)
    with pytest.raises(ValueError, match=r"lone surrogate '\\ud800'"):
        tok.tokenize_batch(["fine", "bad \ud800 text"])


def test_gpt2_ascii_pattern_splits_as_gpt2_pattern():
    # The stdlib-`re` pattern for ASCII text spells GPT-2's classes out: check it on every ASCII
    # character, alone and in random runs with the pieces of the pattern.
    gpt2_pattern = ReferenceGPT2BPE.PATTERN
    for code in range(128):
        text = f"{chr(code)} a{chr(code)}1 {chr(code)}{chr(code)}'s{chr(code)}"
        assert gpt2.ASCII_PATTERN.findall(text) == gpt2_pattern.findall(text), repr(chr(code))
    fragments = [chr(code) for code in range(128)] + ["'s", "'t", "'re", "'ll", "  ", "\n\n", " \t", "ab", "12"]
    rng = random.Random(0)
    for _ in range(50):
        text = "".join(rng.choices(fragments, k=400))
        assert gpt2.ASCII_PATTERN.findall(text) == gpt2_pattern.findall(text)


@pytest.mark.parametrize("tokenizer_type,lower_case", [("BertWordPieceLowerCase", True), ("BertWordPieceCase", False)])
def test_bert_wordpiece_equals_reference_implementation(assets, tokenizer_type, lower_case):
    from transformers.models.bert.tokenization_bert_legacy import BasicTokenizer, WordpieceTokenizer

    tok = build_tokenizer(tokenizer_type, **assets.options[tokenizer_type])
    with open(assets.options[tokenizer_type]["vocab_file"], encoding="utf-8") as f:
        vocab = {line.strip(): i for i, line in enumerate(f)}
    # The original BERT pipeline, as Megatron-LM runs it: no special token survives in text.
    basic = BasicTokenizer(do_lower_case=lower_case, never_split=None)
    wordpiece = WordpieceTokenizer(vocab, unk_token="[UNK]", max_input_chars_per_word=200)
    expected = [
        [vocab[p] for word in basic.tokenize(text) for p in wordpiece.tokenize(word)] for text in assets.texts
    ]
    assert tok.tokenize_batch(assets.texts) == expected
    assert tok.tokenize(assets.texts[0]) == expected[0]
    # Megatron-LM appends [BOS] and [EOS] to the vocab and uses [EOS] as eod.
    assert tok.vocab_size == len(vocab) + 2
    assert (tok.bos, tok.eos, tok.eod) == (len(vocab), len(vocab) + 1, len(vocab) + 1)
    assert (tok.cls, tok.sep, tok.pad, tok.mask) == tuple(vocab[t] for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]"))


def test_wordpiece_training_writes_the_same_vocabulary_every_time(assets, tmp_path):
    """Failed before (huggingface/tokenizers issue 1794): the trainer numbered the ``##`` pieces in hash-map order,
    so each training wrote another vocab.txt, and the BERT tests trained and fine-tuned on other token ids in each
    session (test_examples' classifier stayed at chance in about one session in six)."""
    from megatron_patch.data.train_tokenizer import train_tokenizer

    vocabularies = []
    for run in range(3):
        [path] = train_tokenizer("wordpiece", assets.corpus, str(tmp_path / str(run)), vocab_size=1000)
        with open(path, encoding="utf-8") as f:
            vocabularies.append(f.read().splitlines())
    assert vocabularies[1] == vocabularies[0] and vocabularies[2] == vocabularies[0]
    with open(assets.options["BertWordPieceLowerCase"]["vocab_file"], encoding="utf-8") as f:
        assert f.read().splitlines() == vocabularies[0]  # the session's, trained once from the same corpus
    assert len(vocabularies[0]) == 1000 and vocabularies[0][:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def test_sentencepiece_equals_library_and_encodes_special_tokens(assets):
    import sentencepiece

    options = assets.options["SentencePieceTokenizer"]
    sp = sentencepiece.SentencePieceProcessor(model_file=options["tokenizer_model"])
    tok = build_tokenizer("SentencePieceTokenizer", **options, vocab_extra_ids=2)
    plain = [t for t in assets.texts if "<" not in t]
    assert tok.tokenize_batch(plain) == [sp.encode_as_ids(t) for t in plain]
    # Megatron-LM's extra tokens come after the model's pieces, in this order.
    n = len(sp)
    assert (tok.cls, tok.sep, tok.eod, tok.mask, tok.pad) == (n, n + 1, n + 2, n + 3, n + 4)
    assert tok.additional_special_tokens_ids == [n + 5, n + 6] and tok.vocab_size == n + 7
    assert (tok.bos, tok.eos) == (sp.bos_id(), sp.eos_id())
    text = "a<SEP>b</s><extra_id_1>"
    assert tok.tokenize(text) == sp.encode_as_ids("a") + [tok.sep] + sp.encode_as_ids("b") + [tok.eos, n + 6]


def test_sentencepiece_variants(assets):
    import sentencepiece

    options = assets.options["SentencePieceTokenizer"]
    sp = sentencepiece.SentencePieceProcessor(model_file=options["tokenizer_model"])
    gpt = build_tokenizer("GPTSentencePieceTokenizer", **options)
    llama = build_tokenizer("Llama2Tokenizer", **options)
    text = "x = 1  # <SEP> stays text"
    assert gpt.tokenize(text) == sp.encode_as_ids(text) and gpt.eod == sp.eos_id() == gpt.vocab_size - len(sp) + 2
    assert llama.tokenize(text) == [sp.bos_id()] + sp.encode_as_ids(text) and llama.eod == sp.eos_id()


def test_llama2_tokenizer_refuses_a_model_without_bos(assets, tmp_path):
    import sentencepiece

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(assets.texts))
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "nobos"), vocab_size=300,
                                             bos_id=-1, minloglevel=2)
    model = str(tmp_path / "nobos.model")
    assert build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model).tokenize("x = 1")
    with pytest.raises(TokenizerFileError, match=f"{model}: the SentencePiece model has no bos piece"):
        build_tokenizer("Llama2Tokenizer", tokenizer_model=model)


def test_huggingface_tokenizer_equals_transformers(assets):
    from transformers import AutoTokenizer

    path = assets.options["HuggingFaceTokenizer"]["tokenizer_model"]
    reference = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)
    expected = [reference(text).input_ids for text in assets.texts]
    assert tok.tokenize_batch(assets.texts) == expected
    assert tok.tokenize(assets.texts[1]) == expected[1]
    assert (tok.vocab_size, tok.eod, tok.pad) == (len(reference), reference.eos_token_id, reference.pad_token_id)


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.tokenize("5 17 3") == [5, 17, 3] and tok.detokenize([5, 17, 3]) == "5 17 3"
    assert (tok.vocab_size, tok.eod) == (101, 100)
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("5 100")
    with pytest.raises(ValueError, match="space-separated integers"):
        tok.tokenize("five")



ALL_SPECIAL_TOKENS = {"cls", "sep", "pad", "eod", "bos", "eos", "mask"}
# The special-token properties each type answers; the rest raise NotImplementedError, as Megatron-LM's tokenizers
# (megatron-core 0.16.1's MegatronLegacyTokenizer base) do, which callers probing for a token (`try: tok.mask`) rely on.
ANSWERED_SPECIAL_TOKENS = {
    "GPT2BPETokenizer": {"eod", "eos"},
    "BertWordPieceLowerCase": ALL_SPECIAL_TOKENS,
    "BertWordPieceCase": ALL_SPECIAL_TOKENS,
    "SentencePieceTokenizer": ALL_SPECIAL_TOKENS,
    "GPTSentencePieceTokenizer": {"pad", "eod", "bos", "eos"},
    "Llama2Tokenizer": {"pad", "eod", "bos", "eos"},
    "HuggingFaceTokenizer": {"pad", "eod", "bos", "eos"},
    "NullTokenizer": {"eod", "eos"},
}


@pytest.mark.parametrize("tokenizer_type", sorted(ANSWERED_SPECIAL_TOKENS))
def test_special_token_properties_answered_and_refused(assets, tokenizer_type):
    tok = build_tokenizer(tokenizer_type, **assets.options[tokenizer_type])
    answered = ANSWERED_SPECIAL_TOKENS[tokenizer_type]
    for name in sorted(ALL_SPECIAL_TOKENS - answered):
        with pytest.raises(NotImplementedError, match=rf"^{tokenizer_type} has no attribute '{name}'$"):
            getattr(tok, name)
    ids = {name: getattr(tok, name) for name in answered}
    # eod is eos wherever a type has no end-of-document token of its own; ids are in the vocab (Null's eod is the
    # one past it); a SentencePiece model trained without a pad piece has pad None (SentencePieceTokenizer adds one).
    assert ids["eod"] == ids["eos"] or tokenizer_type == "SentencePieceTokenizer"
    assert all(i is None or 0 <= i < tok.vocab_size for i in ids.values()), ids
    assert ("pad" in ids and ids["pad"] is None) == (tokenizer_type in ("GPTSentencePieceTokenizer", "Llama2Tokenizer"))


def test_padded_vocab_size():
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 8) == 51200
    assert padded_vocab_size(1024, 128, 2) == 1024
    with pytest.raises(ValueError, match="make-vocab-size-divisible-by"):
        padded_vocab_size(100, 0, 1)


@pytest.mark.parametrize("tokenizer_type", sorted(ANSWERED_SPECIAL_TOKENS))
@pytest.mark.parametrize("dtype", [numpy.uint16, numpy.int32])
def test_flat_batch_is_the_batch_concatenated(assets, tokenizer_type, dtype):
    tok = build_tokenizer(tokenizer_type, **assets.options[tokenizer_type])
    texts = ["12 7 3", "", "1 2"] if tokenizer_type == "NullTokenizer" else [*assets.texts[:20], "", "x"]
    expected = tok.tokenize_batch(texts)
    ids, lengths = tok.tokenize_batch_flat(texts, dtype)
    assert ids.dtype == dtype and lengths.tolist() == [len(e) for e in expected]
    assert ids.tolist() == [i for e in expected for i in e]


def test_gpt2_flat_batch_refuses_ids_its_dtype_cannot_hold(assets, tmp_path):
    # A vocab.json with ids past 65535 but fewer tokens than Megatron-LM's uint16 limit: asked for uint16 (the
    # dtype its size gives), the ids must be refused, as numpy refuses them in Megatron-LM's add_document, not
    # wrapped silently.
    options = assets.options["GPT2BPETokenizer"]
    with open(options["vocab_file"], encoding="utf-8") as f:
        vocab = {token: i + 70000 for token, i in json.load(f).items()}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"), merge_file=options["merge_file"])
    ids, _ = tok.tokenize_batch_flat(assets.texts[:3], numpy.int32)
    assert ids.tolist() == [i for t in tok.tokenize_batch(assets.texts[:3]) for i in t] and ids.min() >= 70000
    with pytest.raises(OverflowError):
        tok.tokenize_batch_flat(assets.texts[:3], numpy.uint16)


def test_builtin_names_are_where_their_modules_register_them():
    # The names are listed without importing the modules (see registry.BUILTIN_TOKENIZERS); each must be the one
    # its module registers, and every tokenizer a module of this package registers must be listed.
    registered = load_tokenizers()
    for name, module in BUILTIN_TOKENIZERS.items():
        assert registered[name][0].__module__ == module, name
    ours = {name for name, (cls, _) in registered.items() if cls.__module__.startswith("megatron_patch.tokenizer.")}
    assert ours == set(BUILTIN_TOKENIZERS)
    assert tokenizer_names() == sorted(set(BUILTIN_TOKENIZERS) | set(registered))


def test_registry_names_and_unknown_type():
    assert {"GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer",
            "HuggingFaceTokenizer", "NullTokenizer"} <= set(TOKENIZERS)
    with pytest.raises(ValueError, match="GPT2BPETokenizer"):
        build_tokenizer("GPT3Tokenizer")


def test_tokenizers_work_with_megatron_core_hashing(assets):
    # megatron-core's datasets hash the tokenizer's unique_identifiers into cache names.
    tok = build_tokenizer("GPT2BPETokenizer", **assets.options["GPT2BPETokenizer"])
    assert tok.unique_identifiers["class"] == "GPT2BPETokenizer"
    json.dumps(tok.unique_identifiers)


def test_missing_and_wrong_format_tokenizer_files(assets, tmp_path):
    gpt2 = assets.options["GPT2BPETokenizer"]
    bert_vocab = assets.options["BertWordPieceLowerCase"]["vocab_file"]
    with pytest.raises(TokenizerFileError, match="needs --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2["vocab_file"])
    with pytest.raises(TokenizerFileError, match="nope.json: no such file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "nope.json"), merge_file=gpt2["merge_file"])
    # A BERT vocab.txt where a GPT-2 vocab.json belongs: named with its line.
    with pytest.raises(TokenizerFileError, match=r"vocab.txt:1: not a GPT-2 vocab.json"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=bert_vocab, merge_file=gpt2["merge_file"])
    # The two GPT-2 files swapped.
    with pytest.raises(TokenizerFileError, match=r"merges.txt:1: not a GPT-2 vocab.json"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2["merge_file"], merge_file=gpt2["vocab_file"])
    broken_merges = tmp_path / "merges.txt"
    broken_merges.write_text("#version: 0.2\nĠ t\nthree tokens here\n", encoding="utf-8")
    with pytest.raises(TokenizerFileError, match=r"merges.txt:3: not a GPT-2 merges.txt line"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2["vocab_file"], merge_file=str(broken_merges))
    with pytest.raises(TokenizerFileError, match=r"vocab.json: not a BERT WordPiece vocab.txt"):
        build_tokenizer("BertWordPieceCase", vocab_file=gpt2["vocab_file"])
    with pytest.raises(TokenizerFileError, match=r"vocab.json: not a SentencePiece .model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=gpt2["vocab_file"])
    with pytest.raises(TokenizerFileError, match="not a directory"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model="gpt2")


def _imported_modules(path: pathlib.Path, package: str) -> set[str]:
    """Every module an `import` or `from ... import` in `path` names, relative imports resolved against `package`
    (`from megatron_patch import data` names `megatron_patch` and `megatron_patch.data`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] if node.level else [])
            base = ".".join(filter(None, (base, node.module)))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_tokenizer_package_imports_nothing_above_it():
    # data/, training/ and convert/ build on tokenizer/; an import back up would be a cycle, and would load the
    # data tools (or the trainer) into every process that only needs a tokenizer.
    root = pathlib.Path(megatron_patch.tokenizer.__file__).parent
    above = ("megatron_patch.data", "megatron_patch.training", "megatron_patch.convert")
    modules = sorted(root.rglob("*.py"))
    assert {"registry.py", "gpt2.py"} <= {m.name for m in modules}
    upward = []
    for module in modules:
        package = ".".join(("megatron_patch", *module.relative_to(root.parent).parent.parts))
        upward += [
            f"{module.relative_to(root.parent)} imports {name}"
            for name in sorted(_imported_modules(module, package))
            if any(name == a or name.startswith(a + ".") for a in above)
        ]
    assert not upward, f"the tokenizer package imports a package that builds on it: {upward}"
