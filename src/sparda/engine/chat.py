"""Chat messages to prompt token ids, through the tokenizer's own chat template.

sparda adds nothing to the conversation: no system prompt of its own, no edits. What
the model's template does with the messages is the model's choice (SmolLM2's template,
for instance, inserts its default system line when the conversation has none; pass a
``system`` message to replace it).
"""

from __future__ import annotations

from sparda.errors import SpardaError

#: roles a chat template is expected to know
ROLES = ("system", "user", "assistant", "tool", "developer")


def message_text(content) -> str:
    """The text of a message's ``content``: a string, or OpenAI-style parts
    ``[{"type": "text", "text": ...}, ...]`` joined. Raises SpardaError otherwise."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise SpardaError("message content parts must be {'type': 'text', 'text': ...}; "
                              "images and audio are not supported")
        return "".join(p["text"] for p in content)
    raise SpardaError("message content must be a string or a list of text parts")


def check_messages(messages) -> list[dict[str, str]]:
    """Validate one conversation: a non-empty list of ``{"role", "content"}`` dicts, each
    with an optional ``name`` (a string, given to the template as OpenAI's API defines it).

    Returns plain ``{"role": str, "content": str}`` dicts (and ``name`` where given). Raises
    SpardaError naming the first bad message (its index, and what is wrong).
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise SpardaError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise SpardaError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if msg["role"] not in ROLES:
            raise SpardaError(f"messages[{i}] has role {msg['role']!r}; use one of {', '.join(ROLES)}")
        try:
            text = message_text(msg["content"])
        except SpardaError as exc:
            raise SpardaError(f"messages[{i}]: {exc}") from None
        name = msg.get("name")
        if name is not None and not isinstance(name, str):
            raise SpardaError(f"messages[{i}].name must be a string, got {type(name).__name__}")
        out.append({"role": msg["role"], "content": text, **({"name": name} if name is not None else {})})
    return out


def chat_token_ids(tokenizer, messages, check_text=None) -> list[int]:
    """Prompt ids of a conversation: the template applied with the generation prompt (the
    assistant turn opened), then tokenised without extra special tokens, exactly as
    :meth:`sparda.LLM.encode` does with ``chat=True`` for a single user message.
    ``check_text``, if given, is called with the templated text before it is tokenised (the
    server refuses there a text too long to fit, without the seconds of tokenising it).

    Raises:
        SpardaError: bad messages (:func:`check_messages`), or a tokenizer without a chat
            template; whatever ``check_text`` raises.
    """
    messages = check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise SpardaError("this model's tokenizer has no chat template; send a plain prompt "
                          "(/v1/completions, LLM.generate) instead")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja raises its own errors (e.g. "roles must alternate")
        raise SpardaError(f"the chat template refused these messages: {exc}") from None
    if check_text is not None:
        check_text(text)
    return tokenizer.encode(text, add_special_tokens=False)
