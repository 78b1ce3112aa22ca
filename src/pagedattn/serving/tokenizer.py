"""The tokenizer of a GGUF model: transformers builds it from the file's own vocabulary, merges
and chat template (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``); :class:`TextStream`
turns generated token ids into text as they come."""

from __future__ import annotations


def load_tokenizer(gguf_path):
    """A fast tokenizer built by transformers from the GGUF at ``gguf_path`` (a Path)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode(tokenizer, text: str, chat: bool | None = None) -> list[int]:
    """Token ids of ``text``: as one user turn of the chat template (with the generation
    prompt) when ``chat``, raw otherwise; ``chat=None`` uses the template when the tokenizer
    has one."""
    if chat is None:
        chat = has_chat_template(tokenizer)
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns an encoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(text)["input_ids"]]


def eos_ids(tokenizer, cfg) -> list[int]:
    """The end-of-sequence ids of the tokenizer and of the model config (one id or a list)."""
    own = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    ids = {*own, tokenizer.eos_token_id}
    return sorted(int(i) for i in ids if i is not None)


class TextStream:
    """Incremental detokenization of one generated sequence, for streaming.

    :meth:`push` takes the next token id and returns the text it completes: ``""`` while the
    bytes so far end inside a multi-byte UTF-8 character (an emoji or a CJK character split
    across byte-level tokens) or the token is a skipped special token. The pieces concatenate
    to the decoded text, with no ``U+FFFD`` of a character cut in two. This is ``tokenizers``'
    ``DecodeStream`` (the decoder's own pipeline, as vLLM and TGI stream), over the backend of
    a fast tokenizer (``tokenizer.backend_tokenizer``). :meth:`end` gives what is still held
    back when generation stops inside a character (decoded with ``U+FFFD``, as transformers'
    ``TextStreamer`` ends).
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self._tokenizer, self._skip = tokenizer, skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []  # ids pushed since the last text returned

    def push(self, token_id: int) -> str:
        text = self._stream.step(self._tokenizer.backend_tokenizer, int(token_id))
        if text is None:
            self._held.append(int(token_id))
            return ""
        self._held = []
        return text

    def end(self) -> str:
        """The text of the ids still held back (``""`` when none is)."""
        held, self._held = self._held, []
        return self._tokenizer.decode(held, skip_special_tokens=self._skip) if held else ""
