"""Chat templates: our models' own, or a Hugging Face model's `chat_template` (jinja2).

Ours (Phi-3 style, the special tokens of the shipped tokenizer):

    <|endoftext|><|system|>\\n{system}<|end|>\\n<|user|>\\n{user}<|end|>\\n<|assistant|>\\n

It is built from token ids piece by piece, so a message that contains the text "<|user|>"
stays plain text and can never inject a turn. A Hugging Face template is rendered to a string
in a sandbox and encoded with special tokens parsed, as `transformers` does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from splitphase.model.tokenizer import Tokenizer
from splitphase.server.errors import bad_request
from splitphase.server.protocol import ChatMessage

ROLES = ("system", "user", "assistant")
_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system turn
END = "<|end|>"

# The same template as jinja, for clients that render it themselves (`/tokenizer_info`).
OWN_TEMPLATE_JINJA = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Validated `{"role", "content"}` dicts; text parts are joined, other parts are a 400."""
    if not messages:
        raise bad_request("messages must hold at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        role = _ROLE_ALIASES.get(m.role, m.role)
        if role not in ROLES:
            raise bad_request(
                f"messages[{i}].role must be one of {', '.join(ROLES)} (or developer), "
                f"got {m.role!r}",
                f"messages.{i}.role",
            )
        out.append({"role": role, "content": _text(m, i)})
    return out


def _text(m: ChatMessage, i: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    texts = []
    for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"messages[{i}].content[{j}] has type {part.type!r}; only text parts are "
                "supported",
                f"messages.{i}.content",
            )
        texts.append(part.text)
    return "".join(texts)


class ChatTemplate:
    """Turns messages into prompt token ids, and names the tokens that end a turn."""

    def __init__(self, tokenizer: Tokenizer, hf_template: str | None = None,
                 special: dict[str, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.hf_template = hf_template
        self._special = special or {}
        self._compiled: Any = None
        if hf_template is not None:
            self._compiled = _sandbox().from_string(hf_template)

    @classmethod
    def for_model_dir(cls, model_dir: Path | None, tokenizer: Tokenizer) -> ChatTemplate:
        """The model dir's tokenizer_config.json `chat_template` if it has one, else ours."""
        config_path = model_dir / "tokenizer_config.json" if model_dir else None
        if config_path is None or not config_path.is_file():
            return cls(tokenizer)
        try:
            config = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError):
            return cls(tokenizer)
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        special = {k: _token_str(config.get(k)) for k in ("bos_token", "eos_token")}
        return cls(tokenizer, template if isinstance(template, str) else None,
                   {k: v for k, v in special.items() if v})

    @property
    def is_own(self) -> bool:
        """True for our template (built from the special-token ids)."""
        return self.hf_template is None and self._has_chat_tokens()

    def _has_chat_tokens(self) -> bool:
        return all(f"<|{r}|>" in self.tokenizer.special_tokens for r in ROLES)

    def jinja_source(self) -> str | None:
        """The template as jinja (ours or the model's), for `/tokenizer_info`."""
        if self.hf_template is not None:
            return self.hf_template
        return OWN_TEMPLATE_JINJA if self.is_own else None

    def encode(self, messages: list[dict[str, str]],
               add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids for a conversation."""
        if self._compiled is not None:
            return self.tokenizer.encode(self.render(messages, add_generation_prompt),
                                         parse_special=True)
        if not self.is_own:
            return self._plain(messages, add_generation_prompt)
        tok, special = self.tokenizer, self.tokenizer.special_tokens
        ids = [tok.bos_token_id] if tok.bos_token_id is not None else []
        for m in messages:
            ids += [special[f"<|{m['role']}|>"], *tok.encode("\n" + m["content"])]
            ids += [special[END], *tok.encode("\n")]
        if add_generation_prompt:
            ids += [special["<|assistant|>"], *tok.encode("\n")]
        return ids

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The model's jinja template rendered to text (a template error is the client's 400)."""
        from jinja2.exceptions import TemplateError

        try:
            return str(self._compiled.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self._special.get("bos_token", ""),
                eos_token=self._special.get("eos_token", ""),
            ))
        except TemplateError as exc:
            raise bad_request(f"the model's chat template rejected the messages: {exc}",
                              "messages") from exc

    def _plain(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        """A tokenizer without chat tokens and no template: "role: text" lines."""
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        bos = self.tokenizer.bos_token_id is not None
        return self.tokenizer.encode(text + ("assistant:" if add_generation_prompt else ""),
                                     add_bos=bos)

    def stop_token_ids(self) -> list[int]:
        """Tokens that end the assistant's turn (besides the engine's eos)."""
        special = self.tokenizer.special_tokens
        if self.is_own and END in special:
            return [special[END]]
        eos = self._special.get("eos_token")
        return [special[eos]] if eos in special else []


def _token_str(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _sandbox() -> Any:
    """A jinja2 sandbox configured as `transformers` renders chat templates."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                               indent=indent)
    return env
