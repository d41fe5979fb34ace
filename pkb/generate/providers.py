"""Model providers: one call = one chat completion, with retries, a timeout, token usage and cost.

A model is named ``provider:model``. The provider is a preset that fixes the protocol (OpenAI
chat completions, Anthropic messages, or a folder's files), the endpoint and the environment variables it reads::

    openai:gpt-5                      OPENAI_API_KEY, OPENAI_BASE_URL (any OpenAI-compatible endpoint)
    together:Qwen/Qwen3-Coder-480B-A35B-Instruct-FP8   TOGETHER_API_KEY
    openrouter:anthropic/claude-sonnet-4.5             OPENROUTER_API_KEY
    vllm:my-model                     VLLM_BASE_URL (default: vLLM's own default address), key optional
    sglang:my-model                   SGLANG_BASE_URL (default: SGLang's own default address), key optional
    anthropic:claude-sonnet-4-5       ANTHROPIC_API_KEY, ANTHROPIC_BASE_URL
    replay:DIR                        no network, no key: the files of a folder answer (``replay_file``)

``connect(spec, settings)`` checks the key and imports the SDK (``pip install 'pkb[generate]'``)
before any work starts. ``replay:DIR`` answers each call with a file of ``DIR`` chosen by the problem and
the sample or step the call is for (``CallContext``), so the whole generate / agent / report loop runs
offline, and a recorded run (``pkb generate``'s ``<out>/<run>/``) replays; docs/generation.md gives the
layout. The SDKs' own retries are switched off: ``Provider.complete`` retries rate
limits (429), server errors (5xx, 529), timeouts and dropped connections itself, with exponential
backoff (or the server's ``retry-after``), and reports how many attempts a call took.
"""

from __future__ import annotations

import os
import random
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

INSTALL_HINT = "pip install 'pkb[generate]'  (or: pip install openai anthropic)"


class ProviderError(Exception):
    """A model call failed. ``fatal``: every further call would fail the same way (bad key, unknown
    model, unreachable server), so the run stops instead of recording the same error per sample."""

    def __init__(self, message: str, fatal: bool = False, attempts: int = 1):
        super().__init__(message)
        self.fatal = fatal
        self.attempts = attempts


class SetupError(Exception):
    """The provider cannot be used as configured (unknown preset, missing key or SDK): nothing ran yet."""


@dataclass(frozen=True)
class Preset:
    name: str
    protocol: str  # "openai" (chat completions) or "anthropic" (messages)
    base_url: str | None  # None: the SDK's own default endpoint
    base_url_env: str
    key_env: str
    key_required: bool = True
    max_tokens_field: str = "max_tokens"  # OpenAI's own API wants max_completion_tokens
    base_url_required: bool = False  # a local server: no default address to fall back on


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("openai", "openai", None, "OPENAI_BASE_URL", "OPENAI_API_KEY", max_tokens_field="max_completion_tokens"),
    Preset("together", "openai", "https://api.together.xyz/v1", "TOGETHER_BASE_URL", "TOGETHER_API_KEY"),
    Preset("openrouter", "openai", "https://openrouter.ai/api/v1", "OPENROUTER_BASE_URL", "OPENROUTER_API_KEY"),
    # Local servers: where they listen is the user's to say (VLLM_BASE_URL / SGLANG_BASE_URL or --base-url).
    Preset("vllm", "openai", None, "VLLM_BASE_URL", "VLLM_API_KEY", key_required=False, base_url_required=True),
    Preset("sglang", "openai", None, "SGLANG_BASE_URL", "SGLANG_API_KEY", key_required=False, base_url_required=True),
    Preset("anthropic", "anthropic", None, "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY"),
    # Offline: the model is a folder of answers (replay_file); nothing is sent anywhere, nothing costs.
    Preset("replay", "replay", None, "", "", key_required=False),
)}

# List prices in USD per million tokens (input, output), as published by the vendors in late 2025.
# Looked up by exact model name (a trailing date such as -2025-08-07 or -20250929 is ignored);
# any other model's cost is None (unknown), never a guess. Override with --price IN,OUT.
PRICES_PER_MTOK: dict[str, tuple[float, float]] = {
    "gpt-5": (1.25, 10.0), "gpt-5-mini": (0.25, 2.0), "gpt-5-nano": (0.05, 0.40),
    "gpt-4.1": (2.0, 8.0), "gpt-4.1-mini": (0.40, 1.60), "gpt-4o": (2.50, 10.0),
    "o3": (2.0, 8.0), "o4-mini": (1.10, 4.40),
    "claude-opus-4-5": (5.0, 25.0), "claude-opus-4-1": (15.0, 75.0), "claude-opus-4": (15.0, 75.0),
    "claude-sonnet-4-5": (3.0, 15.0), "claude-sonnet-4": (3.0, 15.0), "claude-haiku-4-5": (1.0, 5.0),
}
_DATE_SUFFIX = re.compile(r"-(\d{4}-\d{2}-\d{2}|\d{8})$")


@dataclass(frozen=True)
class ModelSpec:
    """``provider:model``, e.g. ``openai:gpt-5``, ``together:Qwen/Qwen3-Coder``, ``vllm:my-model``."""

    provider: str
    model: str

    @classmethod
    def parse(cls, text: str) -> "ModelSpec":
        provider, sep, model = text.partition(":")
        if not sep or not provider or not model:
            raise SetupError(f"model {text!r}: write provider:model, e.g. openai:gpt-5 or anthropic:claude-sonnet-4-5 "
                             f"(providers: {', '.join(PRESETS)})")
        if provider not in PRESETS:
            raise SetupError(f"unknown provider {provider!r} in {text!r}; providers: {', '.join(PRESETS)} "
                             "(any OpenAI-compatible server: openai:MODEL with OPENAI_BASE_URL set)")
        return cls(provider, model)

    def __str__(self) -> str:
        return f"{self.provider}:{self.model}"

    @property
    def replays(self) -> bool:
        """Whether the model is a folder of answers (``replay:DIR``), which reads no prompt."""
        return PRESETS[self.provider].protocol == "replay"


@dataclass(frozen=True)
class ProviderSettings:
    """How calls are made. ``timeout_s`` bounds one HTTP request; ``max_retries`` counts retries after
    the first attempt; backoff doubles from ``backoff_s`` up to ``max_backoff_s``, with jitter."""

    timeout_s: float = 600.0
    max_retries: int = 5
    backoff_s: float = 2.0
    max_backoff_s: float = 60.0
    base_url: str | None = None  # overrides the preset and its environment variable
    price_per_mtok: tuple[float, float] | None = None  # overrides the price table


@dataclass(frozen=True)
class Completion:
    """One model answer with what it cost. ``cost_usd`` is None when the model's price is unknown."""

    text: str
    tokens_in: int | None
    tokens_out: int | None
    cost_usd: float | None
    latency_s: float
    attempts: int
    finish_reason: str = ""


@dataclass(frozen=True)
class Message:
    role: str  # "user" or "assistant"
    content: str


@dataclass(frozen=True)
class CallContext:
    """What one model call is for: a problem (its slug and upstream number), and the sample of ``pkb generate``
    or the step of ``pkb agent``. A model behind an endpoint never sees it; ``replay:DIR`` picks its file by it."""

    problem: str
    upstream_id: int | None = None
    sample: int = 0
    step: int = 0
    kind: str = "sample"  # "sample" (pkb generate) or "step" (pkb agent)

    @property
    def index(self) -> int:
        return self.step if self.kind == "step" else self.sample


def price_of(model: str) -> tuple[float, float] | None:
    name = model.rsplit("/", 1)[-1]  # openrouter's vendor/model names
    return PRICES_PER_MTOK.get(name) or PRICES_PER_MTOK.get(_DATE_SUFFIX.sub("", name))


def cost_usd(price: tuple[float, float] | None, tokens_in: int | None, tokens_out: int | None) -> float | None:
    if price is None or tokens_in is None or tokens_out is None:
        return None
    return (tokens_in * price[0] + tokens_out * price[1]) / 1e6


@dataclass
class _Failure:
    """What one failed attempt means: retry (after ``retry_after`` if the server said), give up on this
    call, or stop the run."""

    message: str
    retryable: bool
    fatal: bool = False
    retry_after: float | None = None
    fatal_if_persistent: bool = False  # e.g. an unreachable server: fatal once the retries are spent


@dataclass
class Provider:
    """A connected model. ``complete`` is safe to call from several threads at once."""

    spec: ModelSpec
    preset: Preset
    settings: ProviderSettings
    base_url: str | None
    send: Callable[[str, list[Message], int, float | None, CallContext | None],
                   tuple[str, int | None, int | None, str]]
    classify: Callable[[Exception], _Failure]
    sleep: Callable[[float], None] = field(default=time.sleep)

    def complete(self, system: str, messages: list[Message], max_tokens: int, temperature: float | None = None,
                 context: CallContext | None = None) -> Completion:
        """One answer; retries transient failures; raises ProviderError when it cannot get one. ``context``:
        what the call is for (``replay:DIR`` needs it; an endpoint ignores it)."""
        started = time.monotonic()
        for attempt in range(self.settings.max_retries + 1):
            try:
                text, tokens_in, tokens_out, finish = self.send(system, messages, max_tokens, temperature, context)
            except ProviderError:
                raise  # said already by the provider (replay:DIR's missing file): nothing to classify or retry
            except Exception as exc:  # noqa: BLE001 — classified below; unknown errors are not retried
                failure = self.classify(exc)
                last = attempt == self.settings.max_retries
                if failure.fatal or not failure.retryable or last:
                    tries = f" (after {attempt + 1} attempts)" if attempt else ""
                    fatal = failure.fatal or (last and failure.fatal_if_persistent)
                    raise ProviderError(f"{self.spec}: {failure.message}{tries}", fatal=fatal,
                                        attempts=attempt + 1) from None
                self.sleep(self._backoff(attempt, failure.retry_after))
                continue
            price = self.settings.price_per_mtok or price_of(self.spec.model)
            return Completion(text, tokens_in, tokens_out, cost_usd(price, tokens_in, tokens_out),
                              time.monotonic() - started, attempt + 1, finish)
        raise AssertionError("unreachable")

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.settings.max_backoff_s)
        delay = min(self.settings.backoff_s * 2**attempt, self.settings.max_backoff_s)
        return delay * (0.5 + random.random() / 2)


def connect(spec: ModelSpec | str, settings: ProviderSettings = ProviderSettings()) -> Provider:
    """A provider ready to call: key found, SDK imported. Raises SetupError saying what to set or install."""
    spec = ModelSpec.parse(spec) if isinstance(spec, str) else spec
    preset = PRESETS[spec.provider]
    if preset.protocol == "replay":
        settings = replace(settings, max_retries=0, price_per_mtok=settings.price_per_mtok or (0.0, 0.0))
        send, classify = _replay(spec)
        return Provider(spec, preset, settings, None, send, classify)
    key = os.environ.get(preset.key_env)
    if preset.key_required and not key:
        raise SetupError(f"{spec}: no API key; set {preset.key_env} (a local server without keys: vllm:MODEL or "
                         "sglang:MODEL, with VLLM_BASE_URL / SGLANG_BASE_URL)")
    base_url = settings.base_url or os.environ.get(preset.base_url_env) or preset.base_url
    if preset.base_url_required and not base_url:
        raise SetupError(f"{spec}: where does the server listen? set {preset.base_url_env} (e.g. the address "
                         f"`{spec.provider}` printed when it started, ending in /v1) or pass --base-url")
    if preset.protocol == "anthropic":
        send, classify = _anthropic(spec, key, base_url, settings)
    else:
        send, classify = _openai(spec, preset, key or "EMPTY", base_url, settings)
    return Provider(spec, preset, settings, base_url, send, classify)


def _import_sdk(name: str):
    try:
        return __import__(name)
    except ImportError:
        raise SetupError(f"the {name} package is needed for this model; {INSTALL_HINT}") from None


def _openai(spec: ModelSpec, preset: Preset, key: str, base_url: str | None, settings: ProviderSettings):
    openai = _import_sdk("openai")
    client = openai.OpenAI(api_key=key, base_url=base_url, timeout=settings.timeout_s, max_retries=0)

    def send(system, messages, max_tokens, temperature, context):
        options = {preset.max_tokens_field: max_tokens}
        if temperature is not None:
            options["temperature"] = temperature
        chat = [{"role": "system", "content": system}] + [{"role": m.role, "content": m.content} for m in messages]
        response = client.chat.completions.create(model=spec.model, messages=chat, **options)
        choice = response.choices[0]
        usage = response.usage
        return (choice.message.content or "", getattr(usage, "prompt_tokens", None),
                getattr(usage, "completion_tokens", None), choice.finish_reason or "")

    return send, lambda exc: _classify(exc, openai, client.base_url, settings.timeout_s)


def _anthropic(spec: ModelSpec, key: str, base_url: str | None, settings: ProviderSettings):
    anthropic = _import_sdk("anthropic")
    client = anthropic.Anthropic(api_key=key, base_url=base_url, timeout=settings.timeout_s, max_retries=0)

    def send(system, messages, max_tokens, temperature, context):
        # temperature travels in the body: recent SDK releases dropped the keyword, the API still takes it
        extra = {"temperature": temperature} if temperature is not None else None
        response = client.messages.create(model=spec.model, system=system, max_tokens=max_tokens,
                                          messages=[{"role": m.role, "content": m.content} for m in messages],
                                          extra_body=extra)
        text = "".join(block.text for block in response.content if getattr(block, "type", "") == "text")
        usage = response.usage
        return (text, getattr(usage, "input_tokens", None), getattr(usage, "output_tokens", None),
                response.stop_reason or "")

    return send, lambda exc: _classify(exc, anthropic, client.base_url, settings.timeout_s)


class NoReplayFile(ProviderError):
    """``replay:DIR`` holds no file that answers a call; the message names the files looked for (the sample's or
    step's status is then ``no_replay_file``, and a rerun asks again)."""


def _replay(spec: ModelSpec):
    """``replay:DIR``: each call answered with the text of ``replay_file(DIR, context)``, no tokens, no cost."""
    folder = Path(spec.model).expanduser()
    if not folder.is_dir():
        raise SetupError(f"{spec}: {folder} is not a folder; replay:DIR answers with the files of DIR, by problem "
                         "(DIR/<slug>.py, DIR/<number>_<name>.py, or DIR/<slug>/sample_<k>.py as `pkb generate` "
                         "writes them: docs/generation.md)")

    def send(system, messages, max_tokens, temperature, context):
        if context is None:
            raise ProviderError(f"{spec}: replay needs to know which problem a call is for (pkb generate and pkb "
                                "agent say)", fatal=True)
        path = replay_file(folder, context)
        if path is None:
            raise NoReplayFile(missing_replay_file(folder, context))
        return path.read_text(encoding="utf-8", errors="replace"), 0, 0, f"replayed {path.name}"

    return send, lambda exc: _Failure(f"{type(exc).__name__}: {exc}", retryable=False)


def replay_file(folder: Path, context: CallContext) -> Path | None:
    """The file of ``folder`` that answers the call ``context`` describes, or None.

    ``<folder>/<slug>/sample_<k>.py`` answers sample k of ``pkb generate`` and ``<folder>/<slug>/step_<k>.py``
    step k of ``pkb agent``: the layout those commands write under ``<out>/<run>/``, so a recorded run replays.
    Else the problem's files at the top of the folder, named as ``pkb run --solutions`` takes them
    (``<slug>.py``, ``<number>_<name>[_<backend>].py``): the k-th in name order answers sample or step k, the
    last one every later k (one file answers every call; a wrong file then a right one scripts a refinement).
    """
    from pkb.solution_files import solution_files

    recorded = folder / context.problem / f"{context.kind}_{context.index}.py"
    if recorded.is_file():
        return recorded
    files = solution_files(folder).get(context.problem, [])
    return files[min(context.index, len(files) - 1)] if files else None


def missing_replay_file(folder: Path, context: CallContext) -> str:
    """What ``replay_file`` looked for and did not find, e.g. ``no file answers allgather sample 3: answers/allgather/
    sample_3.py is missing, and answers holds no allgather.py or 2_<name>[_<backend>].py at its top``."""
    recorded = folder / context.problem / f"{context.kind}_{context.index}.py"
    named = f"{context.problem}.py" + (f" or {context.upstream_id}_<name>[_<backend>].py" if context.upstream_id else "")
    return (f"no file answers {context.problem} {context.kind} {context.index}: {recorded} is missing, and {folder} "
            f"holds no {named} at its top (docs/generation.md, `replay:DIR`)")


def _classify(exc: Exception, sdk, base_url, timeout_s: float) -> _Failure:
    """The same rules for both SDKs, whose exception classes share names and meaning."""
    if isinstance(exc, sdk.APITimeoutError):
        return _Failure(f"no answer within the {timeout_s:g} s request timeout", retryable=True)
    if isinstance(exc, sdk.APIConnectionError):
        return _Failure(f"cannot reach {base_url} ({exc.__cause__ or exc}); is the server running and the URL right?",
                        retryable=True, fatal_if_persistent=True)
    status = getattr(exc, "status_code", None)
    if isinstance(exc, sdk.APIStatusError) and status is not None:
        detail = _error_text(exc)
        if status == 429 or status >= 500:
            return _Failure(f"HTTP {status}: {detail}", retryable=True, retry_after=_retry_after(exc))
        if status in (401, 403):
            return _Failure(f"HTTP {status} (the API key was refused): {detail}", retryable=False, fatal=True)
        if status == 404:
            return _Failure(f"HTTP 404 (unknown model or wrong endpoint {base_url}): {detail}", retryable=False,
                            fatal=True)
        return _Failure(f"HTTP {status}: {detail}", retryable=False)
    return _Failure(f"{type(exc).__name__}: {exc}", retryable=False)


def _error_text(exc) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:500]
    return str(getattr(exc, "message", exc))[:500]


def _retry_after(exc) -> float | None:
    response = getattr(exc, "response", None)
    value = response.headers.get("retry-after") if response is not None else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
