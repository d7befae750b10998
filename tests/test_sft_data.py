"""Conversations to ids and loss masks (`data/conversations.py`) and `preprocess-data --sft`, checked against
transformers' own rendering of each prefix.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_sft_data.py
"""

import json
import os

import numpy
import pytest

from megatron_patch.data.conversations import (
    ConversationEncoder,
    ConversationError,
    detect_format,
    read_conversations,
    split_megatron_conversations,
)
from megatron_patch.data.corpus import write_stdlib_corpus
from megatron_patch.data.jsonl import iter_jsonl_texts
from megatron_patch.data.preprocess import PreprocessConfig, main, preprocess
from megatron_patch.data.train_tokenizer import train_chatml, train_tokenizer
from megatron_patch.tokenizer import build_tokenizer

# Qwen2.5's ChatML template as we write it: tools in the system turn, tool calls as <tool_call> JSON, tool results in
# a user turn. `@@`/`##` become `{% generation %}`/`{% endgeneration %}` in the marked variant and vanish in the plain
# one; the block covers what the prefix rule trains, so both give the same mask.
CHATML = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}"
    "{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}@@"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + (tool_call.arguments | tojson)"
    " + '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}##"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TEMPLATES = {
    "chatml": CHATML.replace("@@", "").replace("##", ""),
    "generation": CHATML.replace("@@", "{% generation %}").replace("##", "{% endgeneration %}"),
}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
RECORDS = {
    "messages-multi-turn": {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is a list in Python?"},
        {"role": "assistant", "content": "A mutable sequence."},
        {"role": "user", "content": "And a tuple?"},
        {"role": "assistant", "content": "An immutable one: (1, 2)."},
    ]},
    "messages-tools": {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "assistant", "content": "It is 21 degrees in Paris."},
    ]},
    "sharegpt-tools": {"system": "Be kind.", "tools": json.dumps([WEATHER]), "conversations": [
        {"from": "human", "value": "Weather in Rome?"},
        {"from": "function_call", "value": "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}"},
        {"from": "observation", "value": "{\"temp\": 25}"},
        {"from": "gpt", "value": "25 degrees."},
        {"from": "human", "value": "Thanks!"},
        {"from": "gpt", "value": "You're welcome."},
    ]},
    "prompt-completion": {"prompt": "Translate 'chat' to English.", "completion": "Cat."},
    "prompt-response": {"prompt": "2 + 2 =", "response": " 4"},
    "prompt-completion-conversational": {
        "prompt": [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"},
                   {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Grass colour?"}],
        "completion": [{"role": "assistant", "content": "Green."}],
    },
    "alpaca": {"system": "You sort.", "instruction": "Sort the numbers.", "input": "3, 1, 2", "output": "1, 2, 3"},
    "alpaca-no-input": {"instruction": "Name a prime.", "input": "", "output": "7"},
}


def _write_hf_tokenizer(path: str, corpus: str, chat_template: str | None) -> str:
    """A byte-level BPE HF tokenizer directory with ChatML's special tokens and, if given, a chat template."""
    train_chatml(iter_jsonl_texts([corpus]), path, 600, chat_template)
    return path


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_assets")
    corpus = str(root / "corpus.jsonl")
    write_stdlib_corpus(corpus, max_docs=60, max_doc_chars=1200)
    dirs = {name: _write_hf_tokenizer(str(root / name), corpus, template) for name, template in TEMPLATES.items()}
    dirs["none"] = _write_hf_tokenizer(str(root / "none"), corpus, None)
    train_tokenizer("gpt2-bpe", corpus, str(root / "gpt2"), vocab_size=600)
    gpt2 = {"vocab_file": str(root / "gpt2" / "vocab.json"), "merge_file": str(root / "gpt2" / "merges.txt")}
    return {"dirs": dirs, "gpt2": gpt2}


def _hf_tokenizer(assets, name):
    return build_tokenizer("HuggingFaceTokenizer", tokenizer_model=assets["dirs"][name])


def reference(hf, conversation, loss="assistant"):
    """ids and mask by transformers alone: every prefix rendered and tokenized by apply_chat_template, an assistant
    turn's trained tokens those between render(messages[:i], add_generation_prompt=True) and render(messages[:i+1])."""

    def ids(messages, prompt=False):
        return list(hf.apply_chat_template(messages, tools=conversation.tools, add_generation_prompt=prompt,
                                           tokenize=True, return_dict=False))

    messages = conversation.messages
    full = ids(messages)
    if loss == "all":
        return full, [1] * len(full)
    mask = [0] * len(full)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= conversation.trained_from]
    for i in turns[-1:] if loss == "last-turn" else turns:
        before, upto = ids(messages[:i], prompt=True), ids(messages[: i + 1])
        assert upto[: len(before)] == before and full[: len(upto)] == upto
        mask[len(before):len(upto)] = [1] * (len(upto) - len(before))
    return full, mask


@pytest.mark.parametrize("template", sorted(TEMPLATES))
@pytest.mark.parametrize("loss", ["assistant", "last-turn", "all"])
def test_masks_equal_transformers_prefix_rendering(assets, template, loss):
    tokenizer = _hf_tokenizer(assets, template)
    encoder = ConversationEncoder(tokenizer, loss=loss)
    conversations = [c for r in RECORDS.values() for c in read_conversations(r, detect_format(r))]
    encoded = encoder.encode(conversations)
    for conversation, result in zip(conversations, encoded):
        ids, mask = reference(tokenizer._hf, conversation, loss)
        assert result.ids.tolist() == ids
        assert result.mask.tolist() == mask, encoder.show(conversation)
        assert loss == "all" or 0 < result.trained_tokens < len(ids)
    if template == "generation" and loss == "assistant":
        # The marks give transformers' own assistant mask, where every assistant turn is trained.
        for conversation, result in zip(conversations, encoded):
            if conversation.trained_from == 0:
                out = tokenizer._hf.apply_chat_template(conversation.messages, tools=conversation.tools,
                                                        return_dict=True, return_assistant_tokens_mask=True)
                assert result.mask.tolist() == out["assistant_masks"]


def test_formats_become_the_messages_llama_factory_and_trl_give(assets):
    [alpaca] = read_conversations(RECORDS["alpaca"], "alpaca")
    assert alpaca.messages[1] == {"role": "user", "content": "Sort the numbers.\n3, 1, 2"}
    assert alpaca.messages[0] == {"role": "system", "content": "You sort."} and alpaca.trained_from == 2
    [sharegpt] = read_conversations(RECORDS["sharegpt-tools"], "sharegpt")
    assert [m["role"] for m in sharegpt.messages] == ["system", "user", "assistant", "tool", "assistant", "user",
                                                       "assistant"]
    assert sharegpt.messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Rome"}}
    assert sharegpt.tools == [WEATHER]
    # Only the completion is trained, not the prompt's few-shot answer.
    [conv] = read_conversations(RECORDS["prompt-completion-conversational"], "prompt-completion")
    encoder = ConversationEncoder(_hf_tokenizer(assets, "chatml"))
    shown = encoder.show(conv)
    assert "[[Green.<|im_end|>\n]]" in shown and "[[Blue" not in shown


def test_loss_modes_nest(assets):
    tokenizer = _hf_tokenizer(assets, "chatml")
    [conv] = read_conversations(RECORDS["messages-multi-turn"], "messages")
    masks = {loss: ConversationEncoder(tokenizer, loss=loss).encode_one(conv).mask for loss in
             ("assistant", "last-turn", "all")}
    assert masks["all"].all()
    assert (masks["last-turn"] <= masks["assistant"]).all() and masks["last-turn"].sum() < masks["assistant"].sum()
    # The last turn's content and end-of-turn token, nothing of the prompt before it.
    text = tokenizer.detokenize(ConversationEncoder(tokenizer).encode_one(conv).ids[masks["last-turn"] == 1])
    assert text == "An immutable one: (1, 2).<|im_end|>\n"


def test_megatron_lm_lines_split_at_each_system_message():
    turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    system = {"role": "system", "content": "s"}
    assert split_megatron_conversations([system, *turn, system, *turn, *turn]) == [[system, *turn],
                                                                                 [system, *turn, *turn]]
    # As Megatron-LM core_v0.19.0's _split_conversations: a leading non-system run is a conversation of its own.
    assert split_megatron_conversations([*turn, system, *turn]) == [turn, [system, *turn]]


def _write_jsonl(path, records):
    with open(path, "w") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


def _sft_config(path, prefix, assets, template="chatml", **options):
    return PreprocessConfig(input=path, output_prefix=str(prefix), tokenizer_type="HuggingFaceTokenizer",
                            tokenizer_options={"tokenizer_model": assets["dirs"][template]}, sft=True, **options)


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_sft_round_trip(assets, tmp_path, workers):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    two = {"messages": [{"role": "system", "content": "s1"}, *RECORDS["messages-multi-turn"]["messages"][1:3],
                        {"role": "system", "content": "s2"}, *RECORDS["messages-multi-turn"]["messages"][3:]]}
    records = [RECORDS["messages-multi-turn"], two, RECORDS["messages-tools"]] * 50
    path = _write_jsonl(tmp_path / "chat.jsonl", records)
    report = preprocess(_sft_config(path, tmp_path / "out" / "chat", assets, workers=workers,
                                    batch_bytes=1 << 16, batch_lines=16))
    tokenizer = _hf_tokenizer(assets, "chatml")
    expected = [reference(tokenizer._hf, c) for r in records for c in read_conversations(r, "messages")]
    assert len(expected) == 200
    dataset = IndexedDataset(str(tmp_path / "out" / "chat_sft_document"))
    assert len(dataset.document_indices) - 1 == len(expected) and len(dataset) == 2 * len(expected)
    for d, (ids, mask) in enumerate(expected):
        assert dataset.document_indices[d + 1] - dataset.document_indices[d] == 2
        assert dataset[2 * d].tolist() == ids and dataset[2 * d + 1].tolist() == mask
        assert dataset[2 * d].dtype == numpy.uint16 == dataset[2 * d + 1].dtype
    with open(tmp_path / "out" / "chat_sft_document.json") as f:
        sidecar = json.load(f)
    assert sidecar == report.sft == {
        "format": "megatron_patch.sft", "version": 1, "input_format": "messages", "sft_loss": "assistant",
        "chat_template_sha256": ConversationEncoder(tokenizer).chat_template_sha256,
        "tokenizer_type": "HuggingFaceTokenizer", "conversations": 200,
        "tokens": sum(len(ids) for ids, _ in expected), "trained_tokens": sum(sum(m) for _, m in expected),
        "max_token_id": max(max(ids) for ids, _ in expected),
    }
    assert f"Done: 200 conversations (messages), {sidecar['tokens']} tokens, {sidecar['trained_tokens']} trained" \
        in report.summary()
    assert sorted(os.listdir(tmp_path / "out")) == [f"chat_sft_document.{e}" for e in ("bin", "idx", "json")]


def _run(argv, capsys):
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _cli(path, prefix, assets, template="chatml", *extra):
    return ["--sft", "--input", str(path), "--output-prefix", str(prefix), "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", assets["dirs"][template], "--workers", "1", *extra]


ASSISTANT_FIRST_ONLY = "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<|im_start|>{{ m.role }}\n" \
    "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
SHOUTING = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | upper if m.role == 'assistant' " \
    "else m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
STRICT = "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('Only user and " \
    "assistant roles are supported') }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize("case", ["unknown-format", "format-mismatch", "unknown-role", "template-raises",
                                  "drops-earlier-turns", "content-not-in-span", "no-template"])
def test_refusals_are_one_line_naming_file_and_line(assets, tmp_path, capsys, case):
    good = RECORDS["messages-multi-turn"]
    lines, extra, template, expected = [good, good], [], "chatml", ""
    if case == "unknown-format":
        lines.append({"question": "?", "answer": "!"})
        expected = "chat.jsonl:3: unknown format: expected 'messages', 'conversations'"
    elif case == "format-mismatch":
        lines.append(RECORDS["alpaca"])
        expected = "chat.jsonl:3: format mismatch: a alpaca record in a file of messages records (line 1 sets"
    elif case == "unknown-role":
        lines.append({"messages": [{"role": "narrator", "content": "Once"}, {"role": "assistant", "content": "x"}]})
        expected = "chat.jsonl:3: unknown role: 'narrator' in messages[0]"
    elif case == "template-raises":
        extra = ["--chat-template", _write(tmp_path / "strict.jinja", STRICT)]
        expected = ("chat.jsonl:1: chat template error: the template refused the conversation (roles: system, user, "
                    "assistant, user, assistant): Only user and assistant roles are supported")
    elif case == "drops-earlier-turns":
        extra = ["--chat-template", _write(tmp_path / "drop.jinja", ASSISTANT_FIRST_ONLY)]
        expected = "chat.jsonl:1: cannot locate assistant text: the chat template renders messages[:3] as no prefix"
    elif case == "content-not-in-span":
        extra = ["--chat-template", _write(tmp_path / "shout.jinja", SHOUTING)]
        expected = ("chat.jsonl:1: cannot locate assistant text: the chat template does not render message 2's "
                    "content in what it adds for that message; give a template with {% generation %} or "
                    "--chat-template FILE")
    elif case == "no-template":
        template = "none"
        expected = "chat.jsonl:1: no chat template: the tokenizer has none, and conversations of messages need one; " \
            "give --chat-template FILE"
    path = _write_jsonl(tmp_path / "chat.jsonl", lines)
    status, _, err = _run(_cli(path, tmp_path / "out" / "chat", assets, template, *extra), capsys)
    assert status == 1
    [line] = [line for line in err.splitlines() if "error:" in line]
    assert expected in line, err
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")


def _write(path, text):
    path.write_text(text)
    return str(path)


def test_skip_invalid_counts_refused_lines(assets, tmp_path):
    bad = {"messages": [{"role": "narrator", "content": "x"}]}
    lines = [RECORDS["alpaca"], bad, RECORDS["alpaca"], "{not json", RECORDS["prompt-response"], RECORDS["alpaca"]]
    path = _write_jsonl(tmp_path / "chat.jsonl", lines)
    report = preprocess(_sft_config(path, tmp_path / "chat", assets, skip_invalid=True))
    assert report.sft["conversations"] == 3 and report.sft["input_format"] == "alpaca"
    assert report.skipped == {"unknown role": 1, "format mismatch": 1, "malformed JSON": 1}
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ids, mask = reference(_hf_tokenizer(assets, "chatml")._hf, read_conversations(RECORDS["alpaca"], "alpaca")[0])
    dataset = IndexedDataset(str(tmp_path / "chat_sft_document"))
    assert [dataset[i].tolist() for i in range(len(dataset))] == [ids, mask] * 3


def test_sft_refuses_document_flags_in_one_line(assets, tmp_path, capsys):
    path = _write_jsonl(tmp_path / "chat.jsonl", [RECORDS["alpaca"]])
    for flags in (["--split-sentences"], ["--append-eod"], ["--json-keys", "text"]):
        with pytest.raises(SystemExit):
            main(_cli(path, tmp_path / "chat", assets, "chatml", *flags))
        assert f"{flags[0]}: not with --sft" in capsys.readouterr().err


def test_show_marks_the_trained_spans_and_writes_nothing(assets, tmp_path, capsys):
    path = _write_jsonl(tmp_path / "chat.jsonl", [RECORDS["alpaca"], RECORDS["messages-multi-turn"]])
    status, out, _ = _run(_cli(path, tmp_path / "out" / "chat", assets, "chatml", "--show", "2"), capsys)
    assert status == 0 and not os.path.exists(tmp_path / "out")
    tokenizer = _hf_tokenizer(assets, "chatml")
    [conv] = read_conversations(RECORDS["messages-multi-turn"], "messages")
    encoded = ConversationEncoder(tokenizer).encode_one(conv)
    assert out.splitlines()[0].startswith("# Trained tokens (loss mask 1") and "between [[ and ]]" in out
    assert f"# conversation 1: {len(encoded.ids)} tokens, {encoded.trained_tokens} trained" in out
    assert ("<|im_start|>user\nAnd a tuple?<|im_end|>\n<|im_start|>assistant\n[[An immutable one: (1, 2).<|im_end|>\n]]"
            in out)
    assert out.split("\n", 1)[1].count("[[") == 2


def test_plain_text_rule_without_a_chat_template(assets, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tokenizer = build_tokenizer("GPT2BPETokenizer", **assets["gpt2"])
    records = [RECORDS["prompt-completion"], RECORDS["prompt-response"], RECORDS["alpaca-no-input"]]
    for i, record in enumerate(records):  # a format per file
        _write_jsonl(tmp_path / f"plain{i}.jsonl", [record])
    report = preprocess(PreprocessConfig(input=str(tmp_path / "plain*.jsonl"), output_prefix=str(tmp_path / "plain"),
                                         sft=True, tokenizer_type="GPT2BPETokenizer", tokenizer_options=assets["gpt2"]))
    assert report.sft["chat_template_sha256"] is None
    assert report.sft["input_format"] == "alpaca+prompt-completion+prompt-response"
    dataset = IndexedDataset(str(tmp_path / "plain_sft_document"))
    for d, (prompt, completion) in enumerate([("Translate 'chat' to English.", "Cat."), ("2 + 2 =", " 4"),
                                              ("Name a prime.", "7")]):
        p, c = tokenizer.tokenize(prompt), tokenizer.tokenize(completion)
        assert dataset[2 * d].tolist() == p + c + [tokenizer.eod]
        assert dataset[2 * d + 1].tolist() == [0] * len(p) + [1] * (len(c) + 1)
    with pytest.raises(ConversationError, match=r"no chat template: .* give --chat-template FILE"):
        ConversationEncoder(tokenizer).encode_one(read_conversations(RECORDS["messages-multi-turn"], "messages")[0])


def test_a_tokenizer_without_offsets_takes_a_template_file_by_the_prefix_rule(assets, tmp_path):
    # GPT-2 BPE pre-tokenizes in Python, so the spans are found by tokenizing each boundary's prefix: the reference
    # rule itself, here with the prefixes transformers renders.
    tokenizer = build_tokenizer("GPT2BPETokenizer", **assets["gpt2"])
    hf = _hf_tokenizer(assets, "chatml")._hf
    encoder = ConversationEncoder(tokenizer, chat_template=TEMPLATES["chatml"])
    for name in ("messages-multi-turn", "alpaca"):
        [conv] = read_conversations(RECORDS[name], detect_format(RECORDS[name]))
        text = hf.apply_chat_template(conv.messages, tokenize=False)
        ids = tokenizer.tokenize(text)
        mask = [0] * len(ids)
        for i, m in enumerate(conv.messages):
            if m["role"] == "assistant" and i >= conv.trained_from:
                before = tokenizer.tokenize(hf.apply_chat_template(conv.messages[:i], tokenize=False,
                                                                   add_generation_prompt=True))
                upto = tokenizer.tokenize(hf.apply_chat_template(conv.messages[: i + 1], tokenize=False))
                mask[len(before):len(upto)] = [1] * (len(upto) - len(before))
        encoded = encoder.encode_one(conv)
        assert encoded.ids.tolist() == ids and encoded.mask.tolist() == mask
        assert 0 < encoded.trained_tokens
