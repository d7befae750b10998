"""Preference pairs to chosen/rejected ids and completion masks (`data/preferences.py`) and `preprocess-data --dpo`,
checked against TRL's own `DPOTrainer` dataset preparation (trl 1.16) on the same pairs, tokenizer and template.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_dpo_data.py
"""

import copy
import json
import os
import random

import numpy
import pytest

from megatron_patch.data.corpus import write_stdlib_corpus
from megatron_patch.data.jsonl import iter_jsonl_texts
from megatron_patch.data.preprocess import PreprocessConfig, main, preprocess
from megatron_patch.data.stand_ins import QWEN2_VOCAB
from megatron_patch.data.train_tokenizer import CHATML_TEMPLATE, train_chatml

# Qwen2-Instruct's ChatML with Qwen2.5's tools block in front, so that a pair's `tools` reach the text.
TOOLS_CHATML = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for tool in tools %}{{- tool | tojson }}"
    "{{- '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}" + CHATML_TEMPLATE
)
STRICT = "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('Only user and " \
    "assistant roles are supported') }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
WORDS = ("return self value import os path operator def class yield none true false list dict keys items the "
         "of and in is for while with").split()


def _words(rng, low=1, high=6):
    return " ".join(rng.choices(WORDS, k=rng.randint(low, high)))


def _cut(rng, text):
    """`text` cut at a random character, often inside a word: tokens then merge across the boundary."""
    at = rng.randint(1, len(text) - 1)
    return text[:at], text[at:]


def _standard(rng, count):
    rows = [
        # Cut inside a word: "o" + "s.path" merges into "os" on one side only, so the prompt's last token is not a
        # prefix of prompt + chosen, and the two answers diverge from the prompt at different tokens.
        {"prompt": "import o", "chosen": "s.path", "rejected": "perator"},
        {"prompt": "def f(self): ret", "chosen": "urn self", "rejected": "ry"},
        {"prompt": "x =", "chosen": " 1<|im_end|>", "rejected": " 2"},  # one already ends with eos
        {"prompt": "", "chosen": "yield", "rejected": "return"},
    ]
    for _ in range(count):
        prompt, start = _cut(rng, _words(rng, 2) + " " + rng.choice(WORDS))
        rows.append({"prompt": prompt, "chosen": start + " " + _words(rng), "rejected": _words(rng)})
    return rows


def _prompt_messages(rng):
    messages = [{"role": "system", "content": _words(rng)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(0, 2)):
        messages += [{"role": "user", "content": _words(rng)}, {"role": "assistant", "content": _words(rng)}]
    return messages + [{"role": "user", "content": _words(rng)}]


def _conversational(rng, count):
    rows = []
    for i in range(count):
        row = {"prompt": _prompt_messages(rng), "chosen": [{"role": "assistant", "content": _words(rng)}],
               "rejected": [{"role": "assistant", "content": _words(rng)}]}
        if i % 4 == 0:
            row["tools"] = json.dumps([WEATHER])  # TRL json.loads a string; a list would change the dataset's schema
        rows.append(row)
    return rows


def _implicit(rng, count):
    rows = []
    for i in range(count):
        prompt = _prompt_messages(rng)
        if i % 3 == 0:  # they agree on a first answer and differ later: the prompt takes it in
            prompt += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": _words(rng)}]
        rows.append({"chosen": prompt + [{"role": "assistant", "content": _words(rng)}],
                     "rejected": prompt + [{"role": "assistant", "content": _words(rng)},
                                           {"role": "user", "content": "and?"}][: 1 + (i % 2)]})
    return rows


def _standard_implicit(rng, count):
    # TRL moves the space before the split to the answers; it shows where a space does not merge with what follows.
    rows = [{"chosen": "The sky is blue.", "rejected": "The sky is green."},
            {"chosen": "x = [1]", "rejected": "x = {1}"}, {"chosen": "Say 中文", "rejected": "Say 日本"},
            {"chosen": "n = 1", "rejected": "n = 2"}]
    for _ in range(count):
        prompt = _words(rng, 2)
        rows.append({"chosen": prompt + " " + _words(rng), "rejected": prompt + " " + _words(rng)})
    return [r for r in rows if r["chosen"] != r["rejected"] and not r["chosen"].startswith(r["rejected"])
            and not r["rejected"].startswith(r["chosen"])]


def _rows():
    rng = random.Random(0)
    return {"standard": _standard(rng, 16), "conversational": _conversational(rng, 16),
            "conversational-implicit-prompt": _implicit(rng, 12),
            "standard-implicit-prompt": _standard_implicit(rng, 8)}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_assets")
    corpus = str(root / "corpus.jsonl")
    write_stdlib_corpus(corpus, max_docs=60, max_doc_chars=1200)
    chatml = str(root / "chatml")
    train_chatml(iter_jsonl_texts([corpus]), chatml, 600, TOOLS_CHATML)
    return {"root": root, "chatml": chatml, "bos": _with_bos(chatml, str(root / "bos"))}


def _with_bos(directory, out):
    """The tokenizer of `directory` adding `<|endoftext|>` in front of every text it encodes, as LLaMA's adds BOS:
    TRL tokenizes plain text with the tokenizer's special tokens and chat renderings without."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    bos = "<|endoftext|>"
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))])
    tokenizer.bos_token = bos
    tokenizer.save_pretrained(out)
    return out


def trl_sequences(tokenizer_dir, rows_by_name, output_dir):
    """TRL's prepared pairs, by name: (chosen ids, chosen mask, rejected ids, rejected mask) each, rebuilt from its
    `prompt_ids`, `chosen_ids`, `rejected_ids` columns as its DataCollatorForPreference joins them."""
    import datasets
    import transformers
    from trl import DPOConfig, DPOTrainer

    datasets.disable_progress_bars()
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=QWEN2_VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32))
    names = list(rows_by_name)
    # One trainer prepares them all: each eval dataset goes through the same `_prepare_dataset` as the train one.
    trainer = DPOTrainer(
        model=model, ref_model=copy.deepcopy(model),
        args=DPOConfig(output_dir=str(output_dir), report_to=[], use_cpu=True, bf16=False),
        train_dataset=datasets.Dataset.from_list(rows_by_name[names[0]]),
        eval_dataset={name: datasets.Dataset.from_list(rows_by_name[name]) for name in names[1:]} or None,
        processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    prepared = {names[0]: trainer.train_dataset, **(trainer.eval_dataset or {})}
    out = {}
    for name in names:
        assert len(prepared[name]) == len(rows_by_name[name])  # nothing dropped by max_length
        out[name] = [tuple(part for answer in ("chosen_ids", "rejected_ids") for part in (
            row["prompt_ids"] + row[answer], [0] * len(row["prompt_ids"]) + [1] * len(row[answer])))
            for row in prepared[name]]
    return out


@pytest.fixture(scope="module")
def oracle(assets):
    rows = _rows()
    return rows, trl_sequences(assets["chatml"], rows, assets["root"] / "trl")


def _write_jsonl(path, records):
    with open(path, "w") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


def _documents(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    assert (numpy.diff(dataset.document_indices) == 4).all()
    return [tuple(dataset[4 * d + i].tolist() for i in range(4)) for d in range(len(dataset.document_indices) - 1)]


def _config(path, prefix, tokenizer_dir, **options):
    return PreprocessConfig(input=str(path), output_prefix=str(prefix), tokenizer_type="HuggingFaceTokenizer",
                            tokenizer_options={"tokenizer_model": tokenizer_dir}, dpo=True, **options)


@pytest.mark.parametrize("workers", [1, 2])
def test_prepared_pairs_equal_trl(assets, oracle, tmp_path, workers):
    rows, expected = oracle
    # A file per format (TRL decides a dataset's format by its first row), read in the glob's sorted order.
    names = sorted(rows)
    for i, name in enumerate(names):
        _write_jsonl(tmp_path / f"pairs-{i}.jsonl", rows[name])
    report = preprocess(_config(tmp_path / "pairs-*.jsonl", tmp_path / "out" / "pairs", assets["chatml"],
                                workers=workers, batch_lines=5))
    documents = _documents(tmp_path / "out" / "pairs_dpo_document")
    want = [sequences for name in names for sequences in expected[name]]
    assert len(documents) == len(want) == sum(map(len, rows.values()))
    for name in names:  # per format, so that a failure names it
        got, documents = documents[:len(expected[name])], documents[len(expected[name]):]
        assert got == expected[name], name

    # The data exercise what the rule is there for: a prompt whose last tokens merge with an answer, and answers
    # that leave the prompt at different tokens (min of the two common prefixes).
    from transformers import AutoTokenizer

    tokenize = AutoTokenizer.from_pretrained(assets["chatml"])
    common = lambda a, b: next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))  # noqa: E731
    cuts = []
    for row in rows["standard"]:
        prompt = tokenize(row["prompt"]).input_ids
        cuts.append((len(prompt), *(common(prompt, tokenize(row["prompt"] + row[key]).input_ids)
                                    for key in ("chosen", "rejected"))))
    assert any(min(chosen, rejected) < prompt for prompt, chosen, rejected in cuts)
    assert any(chosen != rejected for _, chosen, rejected in cuts)

    with open(tmp_path / "out" / "pairs_dpo_document.json") as f:
        sidecar = json.load(f)
    flat = [s for name in names for s in expected[name]]
    assert sidecar == report.dpo == {
        "format": "megatron_patch.dpo", "version": 1, "input_format": "+".join(names),
        "chat_template_sha256": report.dpo["chat_template_sha256"], "tokenizer_type": "HuggingFaceTokenizer",
        "pairs": len(flat), "tokens": sum(len(s[0]) + len(s[2]) for s in flat),
        "completion_tokens": sum(sum(s[1]) + sum(s[3]) for s in flat),
        "max_token_id": max(max(s[0] + s[2]) for s in flat),
    }
    import hashlib

    assert sidecar["chat_template_sha256"] == hashlib.sha256(TOOLS_CHATML.encode()).hexdigest()
    assert f"Done: {len(flat)} pairs ({sidecar['input_format']}), {sidecar['tokens']} tokens, " \
        f"{sidecar['completion_tokens']} completion tokens" in report.summary()
    # No .tokens.json: the sidecar records max_token_id.
    assert sorted(os.listdir(tmp_path / "out")) == [f"pairs_dpo_document.{e}" for e in ("bin", "idx", "json")]


def test_plain_text_is_tokenized_with_the_tokenizers_bos(assets, tmp_path):
    # TRL tokenizes plain text with the tokenizer's special tokens (`tokenizer(text)`), chat renderings without.
    rows = {"standard": _standard(random.Random(1), 6), "conversational": _conversational(random.Random(2), 3)}
    expected = trl_sequences(assets["bos"], rows, tmp_path / "trl")
    assert all(s[0][0] == 0 for s in expected["standard"]) and all(s[0][0] != 0 for s in expected["conversational"])
    for i, name in enumerate(rows):
        _write_jsonl(tmp_path / f"pairs-{i}.jsonl", rows[name])
    preprocess(_config(tmp_path / "pairs-*.jsonl", tmp_path / "pairs", assets["bos"], workers=1))
    assert _documents(tmp_path / "pairs_dpo_document") == expected["standard"] + expected["conversational"]


def _run(argv, capsys):
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _cli(path, prefix, tokenizer_dir, *extra):
    return ["--dpo", "--input", str(path), "--output-prefix", str(prefix), "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_dir, "--workers", "1", *extra]


SKY = [{"role": "user", "content": "Sky?"}]
BLUE, GREEN = [{"role": "assistant", "content": "Blue."}], [{"role": "assistant", "content": "Green."}]
REFUSALS = {
    "no-chosen": ({"prompt": "a", "rejected": "b"}, "missing key: no 'chosen' (keys: 'prompt', 'rejected')"),
    "no-chosen-no-rejected": ({"prompt": "a"}, "missing key: no 'chosen' and no 'rejected'"),
    "mixed-types": ({"prompt": "a", "chosen": BLUE, "rejected": GREEN},
                    "bad pair: 'prompt', 'chosen', 'rejected' must all be strings or all be lists of messages, got "
                    "str, list, list"),
    "equal": ({"prompt": SKY, "chosen": BLUE, "rejected": BLUE},
              "chosen equal to rejected: both render to the same"),
    "equal-after-eos": ({"prompt": "a", "chosen": "b", "rejected": "b<|im_end|>"},
                        "chosen equal to rejected: both render to the same"),
    "implicit-identical": ({"chosen": SKY + BLUE, "rejected": SKY + BLUE},
                           "no completion: 'chosen' and 'rejected' are identical, so the implicit prompt"),
    "implicit-prefix": ({"chosen": SKY + BLUE, "rejected": SKY},
                        "no completion: 'rejected' is the beginning of 'chosen', so the implicit prompt"),
    "implicit-empty": ({"chosen": BLUE, "rejected": GREEN}, "no prompt: 'chosen' and 'rejected' differ from their "
                       "first message, so there is no common beginning to take as the prompt; give 'prompt'"),
    "unknown-role": ({"prompt": [{"role": "narrator", "content": "Once"}], "chosen": BLUE, "rejected": GREEN},
                     "unknown role: 'narrator' in prompt[0]"),
    "whole-conversations-with-prompt": ({"prompt": SKY, "chosen": SKY + BLUE, "rejected": SKY + GREEN},
                                        "bad answer: 'chosen' starts with a user message, not the assistant's answer"),
    "template-raises": ({"prompt": [{"role": "system", "content": "s"}] + SKY, "chosen": BLUE, "rejected": GREEN},
                        "chat template error: the template refused the conversation (roles: system, user): Only user "
                        "and assistant roles are supported"),
    "format-mismatch": ({"prompt": "a", "chosen": "b", "rejected": "c"},
                        "format mismatch: a standard record in a file of conversational records (line 1 sets"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_are_one_line_naming_file_and_line(assets, tmp_path, capsys, case):
    record, expected = REFUSALS[case]
    extra = []
    if case == "template-raises":
        (tmp_path / "strict.jinja").write_text(STRICT)
        extra = ["--chat-template", str(tmp_path / "strict.jinja")]
    good = {"prompt": SKY, "chosen": BLUE, "rejected": GREEN}
    if case.startswith("implicit"):
        good = {"chosen": SKY + BLUE, "rejected": SKY + GREEN}
    if case in ("equal-after-eos", "no-chosen", "no-chosen-no-rejected"):
        good = {"prompt": "a", "chosen": "b", "rejected": "c"}
    path = _write_jsonl(tmp_path / "pairs.jsonl", [good, good, record])
    status, _, err = _run(_cli(path, tmp_path / "out" / "pairs", assets["chatml"], *extra), capsys)
    assert status == 1
    [line] = [line for line in err.splitlines() if "error:" in line]
    assert f"pairs.jsonl:3: {expected}" in line, err
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")


def test_skip_invalid_counts_refused_lines(assets, oracle, tmp_path):
    rows, expected = oracle
    good = rows["conversational"][:3]
    lines = [good[0], REFUSALS["equal"][0], good[1], "{not json", REFUSALS["unknown-role"][0], good[2],
             REFUSALS["no-chosen"][0]]
    path = _write_jsonl(tmp_path / "pairs.jsonl", lines)
    report = preprocess(_config(path, tmp_path / "pairs", assets["chatml"], skip_invalid=True))
    assert report.dpo["pairs"] == 3 and report.dpo["input_format"] == "conversational"
    assert report.skipped == {"chosen equal to rejected": 1, "malformed JSON": 1, "unknown role": 1,
                              "missing key": 1}
    assert _documents(tmp_path / "pairs_dpo_document") == expected["conversational"][:3]


@pytest.mark.parametrize("flags, expected", [
    (["--sft"], "argument --sft: not allowed with argument --dpo"),
    (["--sft-loss", "all"], "--sft-loss: not with --dpo"),
    (["--append-eod"], "--append-eod: not with --dpo"),
    (["--json-keys", "text"], "--json-keys: not with --dpo"),
])
def test_parser_refuses_flags_of_other_modes(assets, tmp_path, capsys, flags, expected):
    path = _write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    with pytest.raises(SystemExit):
        main(_cli(path, tmp_path / "pairs", assets["chatml"], *flags))
    assert expected in capsys.readouterr().err


def test_show_marks_each_sequences_completion_and_writes_nothing(assets, oracle, tmp_path, capsys):
    rows, expected = oracle
    row = {"prompt": SKY, "chosen": BLUE, "rejected": GREEN}
    path = _write_jsonl(tmp_path / "pairs.jsonl", [rows["conversational"][1], row])
    status, out, _ = _run(_cli(path, tmp_path / "out" / "pairs", assets["chatml"], "--show", "2"), capsys)
    assert status == 0 and not os.path.exists(tmp_path / "out")
    [sequences] = trl_sequences(assets["chatml"], {"one": [row]}, tmp_path / "trl")["one"]
    prompt = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nSky?<|im_end|>\n" \
        "<|im_start|>assistant\n"
    assert out.splitlines()[0].startswith("# Completion tokens (mask 1") and "between [[ and ]]" in out
    assert "pairs.jsonl:2: conversational record, one pair, chat template sha256 " in out
    assert f"# chosen: {len(sequences[0])} tokens, {sum(sequences[1])} completion\n" \
           f"{prompt}[[Blue.<|im_end|>\n]]\n" in out
    assert f"# rejected: {len(sequences[2])} tokens, {sum(sequences[3])} completion\n" \
           f"{prompt}[[Green.<|im_end|>\n]]" in out
    # A plain pair whose prompt merges into the answer: the mark starts where TRL's completion does.
    plain = {"prompt": "import o", "chosen": "s.path", "rejected": "perator"}
    path = _write_jsonl(tmp_path / "plain.jsonl", [plain])
    status, out, _ = _run(_cli(path, tmp_path / "out" / "plain", assets["chatml"], "--show", "1"), capsys)
    [sequences] = trl_sequences(assets["chatml"], {"one": [plain]}, tmp_path / "trl")["one"]
    from transformers import AutoTokenizer

    decode = AutoTokenizer.from_pretrained(assets["chatml"]).decode
    start = sequences[1].index(1)
    assert f"{decode(sequences[0][:start])}[[{decode(sequences[0][start:])}]]" in out
    # --show past the end names the count.
    status, _, err = _run(_cli(path, tmp_path / "out" / "plain", assets["chatml"], "--show", "5"), capsys)
    assert status == 1 and "--show 5: --input" in err and "has 1 lines" in err
