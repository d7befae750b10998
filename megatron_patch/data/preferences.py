"""Preference pairs (DPO) from JSONL records, tokenized exactly as TRL 1.16's `DPOTrainer` tokenizes them.

    megatron-patch preprocess-data --dpo --input pairs.jsonl --output-prefix data/pairs \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model qwen2-tokenizer --workers 8

In Python (what `preprocess-data --dpo` runs on each batch of lines):

    encoder = PreferenceEncoder(ConversationEncoder(build_tokenizer("HuggingFaceTokenizer", tokenizer_model="tok")))
    record = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    [encoded] = encoder.encode([read_preference(record, detect_preference_format(record))])
    encoded.chosen.ids, encoded.chosen.mask     # prompt + chosen; mask 1 on the completion's tokens
    encoded.rejected.ids, encoded.rejected.mask

Input formats, one per file, TRL's preference datasets (its "standard" and "conversational" forms):
- `standard`: `prompt`, `chosen`, `rejected` strings;
- `conversational`: `prompt` a list of messages, `chosen` and `rejected` lists of messages that answer it (starting
  with the assistant's);
- `standard-implicit-prompt`, `conversational-implicit-prompt`: `chosen` and `rejected` alone, each the whole text or
  conversation; the prompt is their longest common beginning, as TRL's `extract_prompt` (trl/data_utils.py) takes it
  (for strings a space just before the split goes to the answers).
An optional `tools` list (or JSON string) goes to the chat template, as in the SFT `messages` format.

Tokenization, TRL 1.16's `DPOTrainer._prepare_dataset` (trl/trainer/dpo_trainer.py, `tokenize_fn`):
- conversational: the prompt rendered with `add_generation_prompt=True`, prompt + chosen and prompt + rejected each
  rendered whole, the three texts tokenized without added special tokens (`apply_chat_template(tokenize=True)`);
- standard: the tokenizer's eos appended to chosen and rejected unless they end with it, then
  `tokenizer(prompt)`, `tokenizer(prompt + chosen)`, `tokenizer(prompt + rejected)` with the tokenizer's own special
  tokens (a BOS, say). A tokenizer other than HuggingFace's reads no special tokens in text (GPT-2's `<|endoftext|>`
  is text to it), so there the eod id is appended to the ids instead of the eos text to the answer.
- the completion starts at `prompt_len`, the shorter of the common prefixes of the prompt's ids with prompt + chosen's
  and with prompt + rejected's (TRL's `common_prefix_length`: a template that renders the prompt alone differently,
  or tokens merging across the boundary, move it before the end of the prompt's ids). The chosen sequence is all
  of prompt + chosen's ids, its mask 1 from `prompt_len` on; the same for rejected (TRL's collator rebuilds exactly
  these from `prompt_ids[:prompt_len]` and the rest).

Refused, each a `ConversationError` of one line: a record without `chosen` or `rejected`; values not all strings or
all lists of messages; unknown roles; an implicit prompt that is empty or leaves no answer (chosen and rejected
identical, or one a beginning of the other); an explicit conversational answer that does not start with the
assistant's message (a whole conversation given with its prompt, which TRL would render twice); chosen and
rejected that render to the same tokens; an answer that adds no token after the prompt; a template that raises; a
`chat_template_kwargs` key (TRL passes it to the template, we do not yet).
"""

from dataclasses import dataclass
from typing import Any

import numpy

from megatron_patch.data.conversations import (
    Conversation,
    ConversationEncoder,
    ConversationError,
    EncodedConversation,
    read_messages,
    read_tools,
    the_one_encoded,
)

PREFERENCE_FORMATS = ("standard", "conversational", "standard-implicit-prompt", "conversational-implicit-prompt")
# What `preprocess-data --dpo` writes in `{output_prefix}_dpo_document.json`; the trainer (training/sft.py) reads only
# this format at this version.
DPO_FORMAT, DPO_VERSION = "megatron_patch.dpo", 1


@dataclass
class Preference:
    """One preference pair as TRL's `tokenize_fn` receives it, the prompt explicit.

        Preference(prompt=[{"role": "user", "content": "Sky?"}], chosen=[{"role": "assistant", "content": "Blue."}],
                   rejected=[{"role": "assistant", "content": "Green."}])
    """

    prompt: str | list[dict[str, Any]]
    chosen: str | list[dict[str, Any]]
    rejected: str | list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None

    @property
    def conversational(self) -> bool:
        return isinstance(self.chosen, list)


@dataclass
class EncodedPreference:
    """The chosen and the rejected sequence, each its ids and its completion mask (1: a token whose
    log-probability the DPO loss sums).

        EncodedPreference(chosen=EncodedConversation(ids, mask), rejected=EncodedConversation(ids2, mask2))
    """

    chosen: EncodedConversation
    rejected: EncodedConversation

    @property
    def trained_tokens(self) -> int:
        return self.chosen.trained_tokens + self.rejected.trained_tokens

    @property
    def sequences(self) -> tuple[numpy.ndarray, ...]:
        """What `preprocess-data --dpo` stores of it, one document of these four sequences."""
        return self.chosen.ids, self.chosen.mask, self.rejected.ids, self.rejected.mask


def detect_preference_format(record: Any) -> str:
    """The format of a JSON record (one of PREFERENCE_FORMATS); a ConversationError says why it has none.

    >>> detect_preference_format({"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"})
    'standard'
    >>> detect_preference_format({"chosen": [{"role": "user", "content": "Hi"}], "rejected": []})
    'conversational-implicit-prompt'
    """
    missing = [key for key in ("chosen", "rejected") if key not in record]
    if missing:
        raise ConversationError(
            f"missing key: no {' and no '.join(map(repr, missing))} (keys: {', '.join(map(repr, list(record)[:8]))}); "
            "a preference pair has 'chosen' and 'rejected', and 'prompt' unless they begin with it")
    keys = [key for key in ("prompt", "chosen", "rejected") if key in record]
    kinds = [type(record[key]).__name__ for key in keys]
    if set(kinds) not in ({"str"}, {"list"}):
        raise ConversationError(
            f"bad pair: {', '.join(map(repr, keys))} must all be strings or all be lists of messages, got "
            f"{', '.join(kinds)}")
    form = "standard" if kinds[0] == "str" else "conversational"
    return form if "prompt" in record else f"{form}-implicit-prompt"


def extract_prompt(chosen, rejected):
    """TRL's `extract_prompt` (trl/data_utils.py, 1.16): (prompt, chosen, rejected), the prompt their longest common
    beginning; a string's space just before the split goes to the answers. Refuses what TRL would mangle: no common
    beginning (TRL indexes `chosen[-1]` there), or no difference within the shorter (TRL cuts one element early).

    >>> extract_prompt("The sky is blue.", "The sky is green.")
    ('The sky is', ' blue.', ' green.')
    """
    split = next((i for i, (c, r) in enumerate(zip(chosen, rejected)) if c != r), None)
    if split is None:
        shorter, longer = ("rejected", "chosen") if len(chosen) > len(rejected) else ("chosen", "rejected")
        what = ("'chosen' and 'rejected' are identical" if len(chosen) == len(rejected)
                else f"{shorter!r} is the beginning of {longer!r}")
        raise ConversationError(
            f"no completion: {what}, so the implicit prompt (their common beginning) leaves no answer to prefer")
    if split == 0:
        raise ConversationError(
            f"no prompt: 'chosen' and 'rejected' differ from their first "
            f"{'message' if isinstance(chosen, list) else 'character'}, so there is no common beginning to take as "
            "the prompt; give 'prompt'")
    if isinstance(chosen, str) and chosen[split - 1] == " ":
        split -= 1
    return chosen[:split], chosen[split:], rejected[split:]


def read_preference(record: dict, input_format: str) -> Preference:
    """The pair of a record of `input_format` (see `detect_preference_format`), its prompt explicit.

        read_preference({"chosen": "The sky is blue.", "rejected": "The sky is green."}, "standard-implicit-prompt")
        # Preference(prompt='The sky is', chosen=' blue.', rejected=' green.')
    """
    if "chat_template_kwargs" in record:
        raise ConversationError("unsupported key: 'chat_template_kwargs' (TRL passes it to the template; we do not)")
    tools = read_tools(record)
    if input_format.startswith("standard"):
        prompt, chosen, rejected = record.get("prompt", ""), record["chosen"], record["rejected"]
    else:
        chosen, rejected = read_messages(record["chosen"], "chosen"), read_messages(record["rejected"], "rejected")
        prompt = read_messages(record["prompt"], "prompt") if "prompt" in record else []
    if input_format.endswith("implicit-prompt"):
        return Preference(*extract_prompt(chosen, rejected), tools=tools)
    if input_format == "conversational":
        for key, answer in (("chosen", chosen), ("rejected", rejected)):
            if answer[0]["role"] != "assistant":
                raise ConversationError(
                    f"bad answer: {key!r} starts with a {answer[0]['role']} message, not the assistant's answer to "
                    "'prompt'; for whole conversations leave 'prompt' out (their common beginning is the prompt)")
    return Preference(prompt, chosen, rejected, tools)


def _common_prefix_length(ids: list[int], other: list[int]) -> int:
    """TRL's `common_prefix_length` (trl/data_utils.py): how many leading ids the two have in common."""
    length = 0
    for token, other_token in zip(ids, other):
        if token != other_token:
            break
        length += 1
    return length


class PreferenceEncoder:
    """Tokenizes preference pairs as TRL 1.16's DPOTrainer does, a batch in one tokenizer call.

        encoder = PreferenceEncoder(ConversationEncoder(tokenizer, chat_template=None))
        results = encoder.encode(pairs)   # EncodedPreference, or ConversationError for one refused

    The conversational texts are rendered by `conversations` (the tokenizer's chat template or `--chat-template`).
    """

    def __init__(self, conversations: ConversationEncoder):
        self.conversations = conversations
        self.tokenizer = conversations.tokenizer
        self.chat_template_sha256 = conversations.chat_template_sha256
        self._hf = getattr(self.tokenizer, "_hf", None)

    def _texts(self, pair: Preference) -> list[str]:
        """The prompt's text, prompt + chosen's and prompt + rejected's, as TRL tokenizes them."""
        if pair.conversational:
            if self.conversations.chat_template is None:
                raise ConversationError(
                    "no chat template: the tokenizer has none, and pairs of messages need one; give --chat-template "
                    "FILE (a jinja template)")
            render = self.conversations.render_text
            return [render(Conversation(pair.prompt, pair.tools), generation_prompt=True),
                    render(Conversation(pair.prompt + pair.chosen, pair.tools)),
                    render(Conversation(pair.prompt + pair.rejected, pair.tools))]
        if self._hf is None:  # the eod id is appended after tokenizing (see the module docstring)
            if self.tokenizer.eod is None:
                raise ConversationError("no eos: the tokenizer has no eod token to end a plain-text answer with")
            return [pair.prompt, pair.prompt + pair.chosen, pair.prompt + pair.rejected]
        eos = self._hf.eos_token
        if eos is None:
            raise ConversationError("no eos: the tokenizer has no eos token to end a plain-text answer with")
        return [pair.prompt] + [pair.prompt + answer + ("" if answer.endswith(eos) else eos)
                                for answer in (pair.chosen, pair.rejected)]

    def _tokenize(self, pairs: list[Preference], texts: list[str]) -> list[list[int]]:
        """The ids of each pair's three texts, in order: one tokenizer call for the rendered, one for the plain."""
        rendered = [p for p in range(len(texts)) if pairs[p // 3].conversational]
        plain = [p for p in range(len(texts)) if not pairs[p // 3].conversational]
        ids: list[list[int]] = [[] for _ in texts]
        if rendered:
            for p, found in zip(rendered, self.conversations.tokenize_rendered([texts[p] for p in rendered])):
                ids[p] = found
        if plain:
            eod = [] if self._hf is not None else [self.tokenizer.eod]
            for p, found in zip(plain, self.tokenizer.tokenize_batch([texts[p] for p in plain])):
                ids[p] = list(found) + (eod if p % 3 else [])  # p % 3 == 0: the prompt
        return ids

    def encode(self, pairs: list[Preference]) -> list["EncodedPreference | ConversationError"]:
        """Each pair's chosen and rejected ids and completion masks, or the ConversationError that refuses it."""
        results: list[EncodedPreference | ConversationError | None] = [None] * len(pairs)
        kept, texts = [], []
        for index, pair in enumerate(pairs):
            try:
                texts += self._texts(pair)
            except ConversationError as error:
                results[index] = error
            else:
                kept.append(index)
        ids = self._tokenize([pairs[i] for i in kept], texts)
        for k, index in enumerate(kept):
            results[index] = _encode_pair(*ids[3 * k: 3 * k + 3])
        return results

    def encode_one(self, pair: Preference) -> EncodedPreference:
        """`encode([pair])[0]`, raising the ConversationError that refuses it."""
        return the_one_encoded(self.encode([pair]))


def _encode_pair(prompt: list[int], chosen: list[int], rejected: list[int]) -> "EncodedPreference | ConversationError":
    if chosen == rejected:
        return ConversationError(f"chosen equal to rejected: both render to the same {len(chosen)} tokens")
    prompt_len = min(_common_prefix_length(prompt, chosen), _common_prefix_length(prompt, rejected))
    encoded = []
    for key, ids in (("chosen", chosen), ("rejected", rejected)):
        if len(ids) <= prompt_len:
            return ConversationError(f"no completion: {key!r} adds no token after the prompt's {prompt_len}")
        mask = numpy.zeros(len(ids), numpy.uint8)
        mask[prompt_len:] = 1
        encoded.append(EncodedConversation(numpy.array(ids, dtype=numpy.int64), mask))
    return EncodedPreference(*encoded)
