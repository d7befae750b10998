"""Conversations from JSONL records, rendered with the tokenizer's own chat template, with a per-token loss mask.

    megatron-patch preprocess-data --sft --input chat.jsonl --output-prefix data/chat \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model qwen2-tokenizer --workers 8

In Python (what `preprocess-data --sft` runs on each batch of lines):

    encoder = ConversationEncoder(build_tokenizer("HuggingFaceTokenizer", tokenizer_model="tok"))
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    [encoded] = encoder.encode(read_conversations(record, detect_format(record)))
    encoded.ids, encoded.mask      # mask[t] == 1: token t is a trained target (the trainer uses mask[1:])

Input formats, one per file (`detect_format` names the one of a record):
- `messages`: OpenAI chat, roles system/user/assistant/tool, an optional top-level `tools` list, assistant
  `tool_calls` kept. A line may hold several conversations as Megatron-LM's SFT data does: each `system` message
  starts the next one (Megatron-LM core_v0.19.0, megatron/training/datasets/sft_dataset.py, `_split_conversations`).
- `sharegpt`: `conversations` of `from`/`value`, as LLaMA-Factory maps them (data/converter.py): human -> user,
  gpt -> assistant, observation -> tool, function_call -> an assistant turn whose `tool_calls` are the JSON in
  its value; an optional `system` and `tools`.
- `prompt-completion`, `prompt-response`: strings, or (TRL's conversational form) lists of messages; only the
  completion is trained, as TRL's `completion_only_loss` does.
- `alpaca`: `instruction`, optional `input` and `system`, `output`; the user turn is the instruction and the
  input joined by one newline, as LLaMA-Factory's AlpacaDatasetConverter joins them.

Trained spans come from the template's `{% generation %}` blocks where it has them (transformers' assistant mask:
every token overlapping a block). Otherwise an assistant turn's span is what the template adds for it: the text of
render(messages[:i+1]) after render(messages[:i], add_generation_prompt=True). A conversation whose spans cannot
be found that way is refused (Megatron-Bridge #3359 trained such conversations on every token, silently).
A tokenizer without a chat template takes string formats as plain text, TRL's rule:
tokenize(prompt) + tokenize(completion) + [eod], the completion and eod trained.
"""

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

import numpy

INPUT_FORMATS = ("messages", "sharegpt", "prompt-completion", "prompt-response", "alpaca")
# What `preprocess-data --sft` writes in `{output_prefix}_sft_document.json`; the trainer (training/sft.py) reads only
# this format at this version.
SFT_FORMAT, SFT_VERSION = "megatron_patch.sft", 1
LOSS_MODES = ("assistant", "last-turn", "all")
ROLES = ("system", "user", "assistant", "tool")
# A message's reasoning under the names transformers' render_jinja_template copies into one another
# (chat_template_utils._REASONING_FIELDS, transformers 5.25).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# LLaMA-Factory's ShareGPT tags (its dataset_info defaults) and the roles they become.
SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "function_call": "assistant", "tool_call": "assistant", "observation": "tool", "tool": "tool",
}

CANNOT_LOCATE = (
    "cannot locate assistant text: the chat template {why}; give a template with {{% generation %}} "
    "or --chat-template FILE"
)


class ConversationError(ValueError):
    """A record that cannot be trained on; the message is one line without the file and line, which the caller adds."""


@dataclass
class Conversation:
    """One conversation, as the chat template receives it.

        Conversation([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    trained_from: int = 0
    """Assistant turns before this message index are context, not trained (a prompt's few-shot answers)."""
    plain: tuple[str, str] | None = None
    """(prompt, completion) of a string record, the text a tokenizer without a chat template trains on."""


@dataclass
class EncodedConversation:
    """Token ids and their loss mask, of equal length.

        EncodedConversation(ids=numpy.array([5, 9, 2]), mask=numpy.array([0, 1, 1], numpy.uint8))
    """

    ids: numpy.ndarray
    mask: numpy.ndarray

    @property
    def trained_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def sequences(self) -> tuple[numpy.ndarray, ...]:
        """What `preprocess-data --sft` stores of it, one document of these sequences."""
        return self.ids, self.mask


def detect_format(record: Any) -> str | None:
    """The input format of a JSON record, None if it has none of them.

    >>> detect_format({"instruction": "Add 2 and 2", "output": "4"})
    'alpaca'
    """
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "prompt" in record and "completion" in record:
        return "prompt-completion"
    if "prompt" in record and "response" in record:
        return "prompt-response"
    if "instruction" in record and "output" in record:
        return "alpaca"
    return None


def describe_formats() -> str:
    """The keys each format needs, for error messages: `unknown format: expected {describe_formats()}`."""
    return ("'messages', 'conversations', 'prompt'+'completion', 'prompt'+'response' or "
            "'instruction'+'output'")


def _string(record: dict, key: str, optional: bool = False) -> str:
    value = record.get(key)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise ConversationError(f"not a string: {key!r} holds {type(value).__name__}")
    return value


def _message(raw: Any, where: str) -> dict[str, Any]:
    """A message with its None-valued keys dropped, as transformers' apply_chat_template drops them."""
    if not isinstance(raw, dict):
        raise ConversationError(
            f"bad message: {where} is a {type(raw).__name__}, not an object with 'role' and 'content'")
    message = {key: value for key, value in raw.items() if value is not None}
    role = message.get("role")
    if role not in ROLES:
        raise ConversationError(f"unknown role: {role!r} in {where}; the roles are {', '.join(ROLES)}")
    if "content" not in message and not message.get("tool_calls"):
        raise ConversationError(f"bad message: {where} ({role}) has no 'content'")
    return message


def read_messages(raw: Any, key: str) -> list[dict[str, Any]]:
    """The messages of `raw`, a record's value under `key`: a non-empty list, each message checked by role.

    >>> read_messages([{"role": "user", "content": "Hi", "name": None}], "prompt")
    [{'role': 'user', 'content': 'Hi'}]
    """
    if not isinstance(raw, list) or not raw:
        raise ConversationError(f"bad message: {key!r} must be a non-empty list of messages")
    return [_message(m, f"{key}[{i}]") for i, m in enumerate(raw)]


def read_tools(record: dict) -> list[dict[str, Any]] | None:
    """A record's `tools`, a list of JSON schemas or a JSON string of one; None without.

    >>> read_tools({"tools": '[{"type": "function"}]'})
    [{'type': 'function'}]
    """
    tools = record.get("tools")
    if isinstance(tools, str):  # LLaMA-Factory keeps them as a JSON string
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as error:
            raise ConversationError(f"bad tools: 'tools' is a string but not JSON ({error.msg})") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ConversationError("bad tools: 'tools' must be a list of JSON schemas (objects)")
    return tools or None


def split_megatron_conversations(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Megatron-LM's split of one `messages` line: each system message starts the next conversation.

    >>> roles = split_megatron_conversations([{"role": r} for r in ("system", "user", "assistant", "system", "user")])
    >>> [[m["role"] for m in conversation] for conversation in roles]
    [['system', 'user', 'assistant'], ['system', 'user']]
    """
    conversations: list[list[dict[str, Any]]] = []
    for message in messages:
        if message["role"] == "system" and conversations and conversations[-1]:
            conversations.append([])
        if not conversations:
            conversations.append([])
        conversations[-1].append(message)
    return conversations


def _sharegpt_turn(raw: Any, index: int) -> dict[str, Any]:
    where = f"conversations[{index}]"
    if not isinstance(raw, dict) or "from" not in raw or not isinstance(raw.get("value"), str):
        raise ConversationError(f"bad message: {where} is not an object with 'from' and a string 'value'")
    tag = raw["from"]
    if tag not in SHAREGPT_ROLES:
        raise ConversationError(f"unknown role: {tag!r} in {where}; ShareGPT's are {', '.join(SHAREGPT_ROLES)}")
    if tag not in ("function_call", "tool_call"):
        return {"role": SHAREGPT_ROLES[tag], "content": raw["value"]}
    # LLaMA-Factory's FunctionFormatter reads the value as one call or a list of calls, {"name", "arguments"}.
    try:
        calls = json.loads(raw["value"])
    except json.JSONDecodeError as error:
        raise ConversationError(f"bad tool call: {where} ({tag}) is not JSON ({error.msg})") from None
    calls = calls if isinstance(calls, list) else [calls]
    if not all(isinstance(c, dict) and "name" in c for c in calls):
        raise ConversationError(f"bad tool call: {where} ({tag}) is not {{\"name\", \"arguments\"}} or a list of them")
    tool_calls = [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}}
                  for c in calls]
    return {"role": "assistant", "content": "", "tool_calls": tool_calls}


def read_conversations(record: dict, input_format: str) -> list[Conversation]:
    """The conversations of one record of `input_format` (several for a Megatron-LM `messages` line).

        read_conversations({"prompt": "2+2=", "completion": "4"}, "prompt-completion")
        # [Conversation(messages=[user '2+2=', assistant '4'], trained_from=1, plain=('2+2=', '4'))]
    """
    if input_format == "messages":
        tools = read_tools(record)
        parts = split_megatron_conversations(read_messages(record["messages"], "messages"))
        return [Conversation(part, tools) for part in parts]
    if input_format == "sharegpt":
        turns = record["conversations"]
        if not isinstance(turns, list) or not turns:
            raise ConversationError("bad message: 'conversations' must be a non-empty list of {from, value} turns")
        messages = [_sharegpt_turn(turn, i) for i, turn in enumerate(turns)]
        system = _string(record, "system", optional=True)
        if system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
        return [Conversation(messages, read_tools(record))]
    if input_format in ("prompt-completion", "prompt-response"):
        answer_key = input_format.split("-")[1]
        prompt, answer = record["prompt"], record[answer_key]
        if isinstance(prompt, str) and isinstance(answer, str):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
            return [Conversation(messages, read_tools(record), trained_from=1, plain=(prompt, answer))]
        if isinstance(prompt, list) and isinstance(answer, list):
            prompt_messages = read_messages(prompt, "prompt")
            return [Conversation(prompt_messages + read_messages(answer, answer_key), read_tools(record),
                                 trained_from=len(prompt_messages))]
        raise ConversationError(
            f"bad prompt: 'prompt' and {answer_key!r} must both be strings or both be lists of messages, got "
            f"{type(prompt).__name__} and {type(answer).__name__}"
        )
    if input_format == "alpaca":
        user = "\n".join(part for part in (_string(record, "instruction"), _string(record, "input", True)) if part)
        output, system = _string(record, "output"), _string(record, "system", optional=True)
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}, {"role": "assistant", "content": output}]
        prompt = "\n".join(part for part in (system, user) if part)
        return [Conversation(messages, trained_from=len(messages) - 1, plain=(prompt, output))]
    raise ValueError(f"unknown input format {input_format!r}; one of {', '.join(INPUT_FORMATS)}")


def load_chat_template(path: str) -> str:
    """The text of a jinja chat template file (`--chat-template FILE`)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as error:
        raise ConversationError(f"--chat-template {path}: {error.strerror}") from None


def _roles(conversation: Conversation) -> str:
    return ", ".join(m["role"] for m in conversation.messages)


class ConversationEncoder:
    """Renders conversations with a chat template and tokenizes them once, batch by batch, with their loss masks.

        encoder = ConversationEncoder(tokenizer, chat_template=None, loss="assistant")
        results = encoder.encode(conversations)   # EncodedConversation, or ConversationError for one refused

    The template is compiled once (transformers caches it by its text); each conversation is rendered as a string
    (its prefixes too, without `{% generation %}`), the trained spans found as character offsets, and all texts of
    a batch tokenized in one call of the Rust tokenizer, whose offsets map the spans to tokens.
    """

    def __init__(self, tokenizer, chat_template: str | None = None, loss: str = "assistant"):
        if loss not in LOSS_MODES:
            raise ValueError(f"--sft-loss {loss}: choose one of {', '.join(LOSS_MODES)}")
        self.tokenizer = tokenizer
        self.loss = loss
        hf = getattr(tokenizer, "_hf", None)
        if chat_template is None and hf is not None and hf.chat_template is not None:
            chat_template = hf.get_chat_template()
        self.chat_template = chat_template
        self.chat_template_sha256 = (
            hashlib.sha256(chat_template.encode("utf-8")).hexdigest() if chat_template is not None else None
        )
        # What apply_chat_template gives the template besides the messages: the special tokens by name.
        if hf is not None:
            self._template_kwargs = dict(hf.special_tokens_map)
        else:
            eod = getattr(tokenizer, "_special_ids", {}).get("eod")
            self._template_kwargs = {"eos_token": tokenizer.inv_vocab[eod]} if eod is not None else {}
        if chat_template is None and tokenizer.eod is None:
            raise ValueError(
                f"the {type(tokenizer).__name__} tokenizer has neither a chat template nor an eod token to end a "
                "plain-text completion; give --chat-template FILE"
            )
        self._generation = chat_template is not None and _has_generation(chat_template)
        # The Rust pipeline apply_chat_template(tokenize=True) runs, with the offsets that map spans to tokens.
        self._backend = getattr(hf, "backend_tokenizer", None)
        if chat_template is not None:
            from transformers.utils.chat_template_utils import render_jinja_template

            from megatron_patch.compat import compile_chat_template

            self._render_jinja = render_jinja_template
            # Rendered directly, the compiled template skips the copies of the messages and of the special tokens
            # render_jinja_template makes on every call, a third of a prefix render; what those copies change
            # (reasoning fields aliased) sends a conversation through it instead.
            self._compiled = compile_chat_template(chat_template)

    # --- rendering -------------------------------------------------------------------------------------------

    def _render(self, conversation: Conversation, messages: list, generation_prompt: bool, marks: bool = False):
        try:
            if not marks and not any(key in m for m in conversation.messages for key in REASONING_FIELDS):
                text = self._compiled.render(messages=messages, tools=conversation.tools, documents=None,
                                             add_generation_prompt=generation_prompt, **self._template_kwargs)
                return text, None
            texts, spans = self._render_jinja(
                [messages], tools=conversation.tools, chat_template=self.chat_template,
                return_assistant_tokens_mask=marks, add_generation_prompt=generation_prompt, **self._template_kwargs,
            )
        except Exception as error:  # jinja's TemplateError from raise_exception, or a template bug
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ConversationError(
                f"chat template error: the template refused the conversation (roles: {_roles(conversation)}): "
                f"{message}"
            ) from None
        return texts[0], (spans[0] if marks else None)

    def render(self, conversation: Conversation) -> tuple[str, list[tuple[int, int]], bool]:
        """The rendered text, the trained character spans, and whether spans are `{% generation %}` blocks
        (trained: every token overlapping one) or exact turn boundaries (tokens from the one starting at the span's
        start to the one starting at its end)."""
        messages = conversation.messages
        if self.loss == "all":
            text, _ = self._render(conversation, messages, False)
            return text, [(0, len(text))], False
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= conversation.trained_from]
        if self.loss == "last-turn":
            assistant = assistant[-1:]
        if self._generation:
            text, spans = self._render(conversation, messages, False, marks=True)
            if conversation.trained_from > 0 and spans:
                context, _ = self._render(conversation, messages[: conversation.trained_from], True)
                spans = [span for span in spans if span[0] >= len(context)]
            if self.loss == "last-turn":
                spans = spans[-1:]
            return text, [tuple(span) for span in spans], True
        text, _ = self._render(conversation, messages, False)
        spans = []
        for i in assistant:
            before, _ = self._render(conversation, messages[:i], True)
            upto = text if i + 1 == len(messages) else self._render(conversation, messages[: i + 1], False)[0]
            if not upto.startswith(before):
                raise ConversationError(CANNOT_LOCATE.format(
                    why=f"renders messages[:{i}] with the generation prompt as no prefix of messages[:{i + 1}]"))
            if not text.startswith(upto):
                raise ConversationError(CANNOT_LOCATE.format(
                    why=f"renders messages[:{i + 1}] as no prefix of the whole conversation"))
            content = messages[i].get("content")
            if isinstance(content, str) and content and content not in upto[len(before):]:
                raise ConversationError(CANNOT_LOCATE.format(
                    why=f"does not render message {i}'s content in what it adds for that message"))
            spans.append((len(before), len(upto)))
        return text, spans, False

    def render_text(self, conversation: Conversation, generation_prompt: bool = False) -> str:
        """The template's text of the whole conversation, with the generation prompt after it if asked: what
        `apply_chat_template(messages, tools=..., add_generation_prompt=..., tokenize=False)` returns."""
        return self._render(conversation, conversation.messages, generation_prompt)[0]

    # --- tokenizing ------------------------------------------------------------------------------------------

    def tokenize_rendered(self, texts: list[str]) -> list[list[int]]:
        """The ids of rendered texts as `apply_chat_template(tokenize=True)` gives them: the template wrote the
        special tokens, the tokenizer adds none."""
        if self._backend is not None:
            return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]
        hf = getattr(self.tokenizer, "_hf", None)
        if hf is not None:
            return hf(texts, add_special_tokens=False).input_ids
        return self.tokenizer.tokenize_batch(texts)

    def encode(self, conversations: list[Conversation]) -> list["EncodedConversation | ConversationError"]:
        """Each conversation's ids and mask, or the ConversationError that refuses it; one tokenizer call for the
        templated ones, one for the plain-text ones."""
        results: list[EncodedConversation | ConversationError | None] = [None] * len(conversations)
        rendered: list[tuple[int, str, list, bool]] = []
        plain: list[int] = []
        for index, conversation in enumerate(conversations):
            try:
                if self.chat_template is None:
                    if conversation.plain is None:
                        raise ConversationError(
                            "no chat template: the tokenizer has none, and conversations of messages need one; "
                            "give --chat-template FILE (a jinja template)")
                    plain.append(index)
                else:
                    rendered.append((index, *self.render(conversation)))
            except ConversationError as error:
                results[index] = error
        if rendered:
            for (index, *_), result in zip(rendered, self._tokenize_rendered([r[1:] for r in rendered])):
                results[index] = result
        if plain:
            for index, result in zip(plain, self._tokenize_plain([conversations[i].plain for i in plain])):
                results[index] = result
        return results

    def encode_one(self, conversation: Conversation) -> EncodedConversation:
        """`encode([conversation])[0]`, raising the ConversationError that refuses it."""
        return the_one_encoded(self.encode([conversation]))

    def _tokenize_rendered(self, rendered: list[tuple[str, list, bool]]):
        texts = [text for text, _, _ in rendered]
        if self._backend is not None:
            encodings = self._backend.encode_batch(texts, add_special_tokens=False)
            for (text, spans, overlap), encoding in zip(rendered, encodings):
                yield _mask_spans(encoding, spans, overlap, len(text))
            return
        # No offsets (SentencePiece, GPT-2 BPE with its own pre-tokenizer): the reference rule itself, each
        # span boundary's prefix tokenized, whose length is the boundary's token index.
        prefixes = [text[:p] for text, spans, _ in rendered for span in spans for p in span]
        all_ids = self.tokenizer.tokenize_batch(texts + prefixes)
        prefix_ids = iter(all_ids[len(texts):])
        for (text, spans, _), ids in zip(rendered, all_ids):
            ids = numpy.array(ids, dtype=numpy.int64)
            mask = numpy.zeros(len(ids), numpy.uint8)
            try:
                for span in spans:
                    bounds = []
                    for p, head in zip(span, (next(prefix_ids), next(prefix_ids))):
                        if p < len(text) and list(ids[: len(head)]) != head:
                            raise ConversationError(CANNOT_LOCATE.format(
                                why=f"text up to character {p} tokenizes as no prefix of the whole conversation"))
                        bounds.append(len(ids) if p >= len(text) else len(head))
                    mask[bounds[0]:bounds[1]] = 1
            except ConversationError as error:
                yield error
                continue
            yield EncodedConversation(ids, mask)

    def _tokenize_plain(self, pairs: list[tuple[str, str]]):
        eod = self.tokenizer.eod
        prompts = self.tokenizer.tokenize_batch([prompt for prompt, _ in pairs])
        hf = getattr(self.tokenizer, "_hf", None)
        completions_text = [completion for _, completion in pairs]
        # A completion continues its prompt: no BOS of its own.
        completions = (hf(completions_text, add_special_tokens=False).input_ids if hf is not None
                       else self.tokenizer.tokenize_batch(completions_text))
        for prompt, completion in zip(prompts, completions):
            ids = numpy.array([*prompt, *completion, eod], dtype=numpy.int64)
            mask = numpy.zeros(len(ids), numpy.uint8)
            mask[len(prompt):] = 1
            yield EncodedConversation(ids, mask)

    # --- showing ---------------------------------------------------------------------------------------------

    def show(self, conversation: Conversation) -> str:
        """The conversation as the model sees it, trained tokens between `[[` and `]]`; refused ones raise.

            print(encoder.show(conversation))
            # <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n[[Hello!<|im_end|>\\n]]
        """
        encoded = self.encode_one(conversation)
        return mark_trained(self.tokenizer, encoded.ids, encoded.mask)


def the_one_encoded(results: list):
    """The one result of an `encode([item])`, raised if it is the ConversationError that refuses the item.

    >>> the_one_encoded([ConversationError("unknown role: 'narrator' in messages[0]")])
    Traceback (most recent call last):
    ...
    megatron_patch.data.conversations.ConversationError: unknown role: 'narrator' in messages[0]
    """
    [result] = results
    if isinstance(result, ConversationError):
        raise result
    return result


def mark_trained(tokenizer, ids: numpy.ndarray, mask: numpy.ndarray) -> str:
    """The text of `ids`, the tokens where `mask` is 1 between `[[` and `]]`.

        mark_trained(tokenizer, numpy.array(ids), numpy.array(mask))   # 'user: Hi assistant: [[Hello!</s>]]'
    """
    ids, pieces, start = numpy.asarray(ids).tolist(), [], 0
    if not ids:
        return ""
    # Runs of equal mask, each decoded whole, so that multi-byte characters split over tokens come out whole.
    for end in [*numpy.flatnonzero(numpy.diff(mask)) + 1, len(ids)]:
        text = tokenizer.detokenize(ids[start:end])
        pieces.append(f"[[{text}]]" if mask[start] else text)
        start = end
    return "".join(pieces)


def _has_generation(chat_template: str) -> bool:
    # transformers' own test for a template that marks its assistant text (chat_template_utils.render_jinja_template).
    return re.search(r"\{\%-?\s*generation\s*-?\%\}", chat_template) is not None


def _first_token(encoding, position: int, end: int, count: int) -> int:
    """The index of the first token that covers a character at or after `position` (before `end`), else `count`.
    The Rust encoding answers per character, which costs less than turning all its offsets into Python tuples."""
    for p in range(position, end):
        token = encoding.char_to_token(p)
        if token is not None:
            return token
    return count


def _last_token(encoding, position: int, end: int) -> int:
    """One past the index of the last token that covers a character in [position, end), else -1."""
    for p in range(end - 1, position - 1, -1):
        token = encoding.char_to_token(p)
        if token is not None:
            return token + 1
    return -1


def _mask_spans(encoding, spans, overlap: bool, length: int) -> "EncodedConversation | ConversationError":
    ids = numpy.array(encoding.ids, dtype=numpy.int64)
    mask = numpy.zeros(len(ids), numpy.uint8)
    for s, e in spans:
        first = _first_token(encoding, s, length, len(ids))
        if overlap:
            # transformers' assistant mask: every token overlapping the block.
            mask[first:max(_last_token(encoding, s, e), first)] = 1
            continue
        last = _first_token(encoding, e, length, len(ids))
        # A token that starts before a boundary and covers it belongs to both sides: the boundary is no token
        # boundary, so the prefix does not tokenize as a prefix of the whole.
        for boundary, index in ((s, first), (e, last)):
            if index < len(ids) and encoding.token_to_chars(index)[0] < boundary:
                return ConversationError(CANNOT_LOCATE.format(
                    why=f"renders turn boundaries (character {boundary}) inside a token"))
        mask[first:last] = 1
    return EncodedConversation(ids, mask)
