"""What the gateway reads out of a paid call: its idempotency key and its usage.

Pure functions over bytes, no I/O. The key decides whether a call was already bought, so its
derivation is fixed here in one place: a header key is used as given (hashed to a fixed width),
a derived key is BLAKE3 of the lineage id and the canonical JSON of the request body. A call to
any other route than ``POST /v1/chat/completions`` has its method, path and query mixed into both
(``route_scope``), so one body sent to two endpoints is two calls. Nothing here may keep or return
the request text itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import blake3

from ksfs.errors import BadInput

KEY_BYTES = 32
HEADER_KEY_MAX = 1024
CHAT_PATH = "/v1/chat/completions"


def is_chat(path: str) -> bool:
    """Whether ``path`` is a chat completion at the provider: OpenAI's, and the same API under
    another prefix (Azure's /openai/deployments/D/chat/completions, a base URL without /v1).
    Such calls get their stream's usage asked for and must end in [DONE] to be kept."""
    return path == CHAT_PATH or path.endswith("/chat/completions")


def route_scope(method: str, path: str, query: bytes = b"") -> bytes:
    """The prefix that keeps one route's keys and digests apart from every other route's.

    Empty for ``POST /v1/chat/completions``: its keys are the ones it had before other routes were
    bought through the gateway, so responses stored then still replay.
    """
    if method == "POST" and path == CHAT_PATH and not query:
        return b""
    return (b"ksfs-route\0" + method.encode("ascii", "replace") + b" "
            + path.encode("utf-8", "surrogateescape") + b"?" + query + b"\0")


def paid_body(scope: bytes, body: bytes, content_type: str | None
              ) -> tuple[bytes, dict[str, Any]]:
    """(canonical bytes, parsed JSON object or {}) of a paid call on the route of ``scope``.

    Chat completions must be a JSON object (BadInput otherwise, as always). Any other route may
    carry what its API takes (a multipart upload, audio, an empty POST): such a body stands for
    itself, exact bytes and content type, since there is no canonical form to find.
    """
    if not scope:
        return canonical_body(body)
    try:
        canon, obj = canonical_body(body)
    except BadInput:
        return (scope + b"raw\0" + (content_type or "").encode("latin-1", "replace") + b"\0"
                + body, {})
    return scope + b"json\0" + canon, obj


def form_model(body: bytes, content_type: str | None) -> str | None:
    """The ``model`` field of a multipart/form-data body (image edits, audio transcriptions
    name their model so), or None: priced as a JSON body's would be (QA: an upload naming a
    model with no price passed a USD budget, costing 0)."""
    ctype = (content_type or "").strip()
    if not ctype.lower().startswith("multipart/form-data"):
        return None
    match = re.search(r'boundary="?([^";]+)"?', ctype, re.IGNORECASE)
    if match is None:
        return None
    delimiter = b"--" + match.group(1).encode("latin-1", "replace")
    for part in body.split(delimiter)[1:]:
        head, sep, value = part.partition(b"\r\n\r\n")
        if not sep:
            continue
        if re.search(rb'content-disposition:[^\r\n]*;\s*name="?model"?(;|\s|\r|$)', head,
                     re.IGNORECASE):
            text = value.removesuffix(b"\r\n").decode("utf-8", "replace").strip()
            return text or None
    return None


def canonical_body(body: bytes) -> tuple[bytes, dict[str, Any]]:
    """(canonical JSON bytes, parsed object) of a request body; BadInput if it is no JSON object.

    Canonical means sorted keys, no insignificant whitespace, UTF-8: two bodies that mean the same
    request give the same bytes, whatever the client's serializer did.
    """
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadInput(f"request body is not JSON: {exc}") from None
    except RecursionError:
        raise BadInput("request body is not JSON this gateway reads: nested too deeply") from None
    if not isinstance(obj, dict):
        raise BadInput("request body must be a JSON object")
    return json_bytes(obj, sort_keys=True), obj


def json_bytes(obj: Any, sort_keys: bool = False) -> bytes:
    """Compact JSON as UTF-8. A string holding a lone surrogate (JSON allows the escape
    "\\ud83d"; a client that cut an emoji in two sends one) has no UTF-8 form: then every
    non-ASCII character is written as an escape, which JSON reads back the same."""
    try:
        return json.dumps(obj, sort_keys=sort_keys, separators=(",", ":"),
                          ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, sort_keys=sort_keys, separators=(",", ":")).encode("ascii")


def header_key(value: str, scope: bytes = b"") -> bytes:
    """The 32-byte store key of an ``Idempotency-Key`` header value on the route of ``scope``."""
    if not value or len(value) > HEADER_KEY_MAX:
        raise BadInput(f"Idempotency-Key must be 1 to {HEADER_KEY_MAX} characters")
    return blake3.blake3(b"ksfs-idempotency-header\0" + scope + value.encode("utf-8")).digest()


def derived_key(lineage: str, canon: bytes) -> bytes:
    """The 32-byte key of a call without a header: BLAKE3(lineage id, canonical body)."""
    return blake3.blake3(b"ksfs-idempotency-derived\0" + lineage.encode("ascii") + b"\0"
                         + canon).digest()


def request_digest(canon: bytes) -> str:
    """Hex BLAKE3 of the canonical body: lets a replay check that a reused header key names the
    same request, without storing the request."""
    return blake3.blake3(canon).hexdigest()


# A request's tokens reckoned from its size: about 4 bytes of JSON per token of English text,
# which overstates a prompt (keys, quotes, escapes count) rather than understates it.
BYTES_PER_TOKEN = 4
COMPLETION_CAPS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
CAP_MAX = 10**7  # a cap or n beyond any model's is reckoned at this (and never overflows)
# A usage figure past this is no call's (a billion tokens): counted as this, and flagged.
USAGE_MAX = 10**9


def estimated_tokens(obj: dict[str, Any], body_bytes: int, default_cap: int | None = None
                     ) -> tuple[int, int | None]:
    """(prompt, completion) tokens a call may cost, reckoned from its request before it is
    bought: the prompt from the body's size, the completion from its own cap, else
    ``default_cap`` (the gateway's completion reserve), times ``n``; completion None when the
    request sets no cap and there is no default (it may generate any number). Only for
    holding back purchases; never counted as usage."""
    prompt = body_bytes // BYTES_PER_TOKEN

    def whole(v: Any) -> int | None:
        return min(v, CAP_MAX) if isinstance(v, int) and not isinstance(v, bool) else None

    cap = next((c for k in COMPLETION_CAPS if (c := whole(obj.get(k))) is not None),
               default_cap)
    if cap is None:
        return prompt, None
    n = whole(obj.get("n")) or 1
    return prompt, max(0, cap) * min(max(1, n), 128)


@dataclass(frozen=True)
class Usage:
    """Token counts of one response; ``known`` False when the response carried no usage, and
    then ``estimated`` when the counts are the gateway's reckoning rather than 0."""

    model: str | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    known: bool = False
    estimated: bool = False  # not known: counted at ``estimated_usage``'s reckoning
    clamped: bool = False  # a figure past USAGE_MAX was reported, and counted as USAGE_MAX
    # Parts of prompt_tokens (their sum never above it) the provider read from or wrote to its
    # prompt cache, priced at the model's cache prices (``PriceTable.cost``).
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    # The part of cache_write_tokens written to Anthropic's one-hour cache (dearer than its
    # five-minute one), from ``usage.cache_creation``.
    cache_write_1h_tokens: int = 0

    @property
    def unattributed(self) -> int:
        """Tokens of the total that are neither prompt nor completion (a usage that gives only
        ``total_tokens``): priced at the model's higher price (``PriceTable.cost``)."""
        return max(0, self.total_tokens - self.prompt_tokens - self.completion_tokens)


# Keys whose string values in an answer are text the model generated: a chat message's content
# (and its refusal, its reasoning), a tool call's arguments, a Responses output's or a
# transcription's text.
TEXT_KEYS = frozenset({"content", "text", "arguments", "refusal", "reasoning_content"})
# Answers that are generated text whole (a transcription asked as text, srt or vtt); not any
# text/*: a front server's HTML page in a 200 is no generation.
TEXT_ANSWERS = frozenset({"text/plain", "text/vtt", "text/srt", "application/x-subrip"})


def text_bytes(obj: Any) -> int:
    """UTF-8 bytes of the generated text in a parsed answer: every string under a TEXT_KEYS key,
    at any depth (walked with a list, not recursion: an answer may nest deeply)."""
    total, todo = 0, [obj]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(v, str):
                    total += len(v.encode("utf-8", "replace")) if k in TEXT_KEYS else 0
                elif isinstance(v, dict | list):
                    todo.append(v)
        elif isinstance(node, list):
            todo.extend(v for v in node if isinstance(v, dict | list))
    return total


def answer_text_bytes(body: bytes, content_type: str) -> int:
    """UTF-8 bytes of the text a whole (not streamed) answer generated: the text fields of a
    JSON answer, all of a text answer (a transcription as text/plain, srt or vtt), none of any
    other (an image, audio: not billed by the token)."""
    if content_type.split(";")[0].strip().lower() in TEXT_ANSWERS:
        return len(body)
    try:
        return text_bytes(json.loads(body.decode("utf-8")))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return 0


def estimated_usage(usage: Usage, prompt_bytes: int, answer_bytes: int) -> Usage:
    """What a call whose answer carried no usage is counted at, rather than 0 tokens (which let
    a provider ignoring ``include_usage`` spend past any budget): its prompt reckoned from the
    request's size as ``estimated_tokens`` reckons it, its completion from the generated text,
    rounded up (any text costs something). Still not ``known``: never taken for a provider's
    figure."""
    prompt = prompt_bytes // BYTES_PER_TOKEN
    completion = -(-answer_bytes // BYTES_PER_TOKEN)
    return Usage(usage.model, prompt, completion, prompt + completion, known=False,
                 estimated=True)


def usage_from(obj: Any, model: str | None) -> Usage | None:
    """The usage an OpenAI-style object carries: its own ``usage``, else that of the
    ``response`` it wraps (the events of a streamed /v1/responses call). Chat completions and
    embeddings count prompt_tokens/completion_tokens; /v1/responses says input_tokens/
    output_tokens for the same two things.

    Cached prompt tokens: OpenAI counts them inside the prompt and says how many were read from
    its cache in ``prompt_tokens_details.cached_tokens`` (``input_tokens_details`` in the
    Responses API); Anthropic leaves them out of ``input_tokens`` and says them apart
    (``cache_read_input_tokens``, ``cache_creation_input_tokens``), and they are added to the
    prompt. Either way the prompt counts them, and ``cache_read_tokens``/
    ``cache_write_tokens`` say which part of it they were. Anthropic splits its writes by how
    long they are kept in ``cache_creation`` (``ephemeral_5m_input_tokens``,
    ``ephemeral_1h_input_tokens``): the one-hour part is ``cache_write_1h_tokens``."""
    u = raw_usage(obj)
    if u is None:
        return None

    clamped = False

    def num(name: str, within: dict[str, Any] | None = None) -> int:
        nonlocal clamped
        v = (u if within is None else within).get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            return 0
        if v > USAGE_MAX:
            # (QA F5: 10**400 tokens overflowed the cost's float, and the call, bought,
            # went unrecorded) Counted, at the most any call can be, and flagged.
            clamped = True
            return USAGE_MAX
        return v

    if not any(num(n) for n in ("prompt_tokens", "input_tokens", "completion_tokens",
                                "output_tokens", "total_tokens", *ANTHROPIC_CACHE)):
        return None  # {} or nulls: no figure, so the answer is counted at an estimate
    # Anthropic's input_tokens leave out the prompt read from or written to its cache
    # (review: a cached prompt counted nothing): counted as prompt, at the cache prices.
    prompt = num("prompt_tokens") or (num("input_tokens") + sum(map(num, ANTHROPIC_CACHE)))
    completion = num("completion_tokens") or num("output_tokens")
    # A total below its parts is no total: the parts were counted by the provider too.
    total = max(num("total_tokens"), prompt + completion)
    # Which part of the prompt was the cache's: never more than the prompt (a figure past it
    # is no part of it; what is left over is priced at the input price, never below).
    cache_write = min(num("cache_creation_input_tokens"), prompt)
    split = u.get("cache_creation")
    write_1h = min(num("ephemeral_1h_input_tokens", split), cache_write) \
        if isinstance(split, dict) else 0
    cached = max((num("cached_tokens", d) for name in OPENAI_CACHE
                  if isinstance(d := u.get(name), dict)), default=0)
    cache_read = min(num("cache_read_input_tokens") or cached, prompt - cache_write)
    return Usage(model, prompt, completion, total, True, clamped=clamped,
                 cache_read_tokens=cache_read, cache_write_tokens=cache_write,
                 cache_write_1h_tokens=write_1h)


ANTHROPIC_CACHE = ("cache_creation_input_tokens", "cache_read_input_tokens")
# Where OpenAI says how many of the prompt's tokens were read from its cache (``cached_tokens``
# inside): chat completions, and the Responses API.
OPENAI_CACHE = ("prompt_tokens_details", "input_tokens_details")


def raw_usage(obj: Any) -> dict[str, Any] | None:
    """The usage object an answer or event carries: its own ``usage``, else that of the
    ``response`` (a /v1/responses event) or ``message`` (Anthropic's message_start) it wraps."""
    if not isinstance(obj, dict):
        return None
    u = obj.get("usage")
    for holder in ("response", "message"):
        if not isinstance(u, dict) and isinstance(obj.get(holder), dict):
            u = obj[holder].get("usage")
    return u if isinstance(u, dict) else None


def model_of(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return None
    for holder in (obj, obj.get("response")):
        if isinstance(holder, dict) and isinstance(holder.get("model"), str) and holder["model"]:
            return holder["model"]
    return None


def not_an_answer(body: bytes, content_type: str, path: str) -> str | None:
    """Why a 2xx JSON-or-chat response is no answer to keep, or None when it may be kept.

    Some providers and proxies answer 200 with an error object, or with an HTML page from a
    front server; stored, it would be replayed to every retry of that call for ever (a
    derived key never changes). A chat completion must be a JSON object; any response that
    says it is JSON must parse, and an object must not carry a top-level ``error``. Other
    bodies (audio, files) stand for themselves.
    """
    is_json = content_type.split(";")[0].strip().lower() == "application/json"
    if not is_json and not is_chat(path):
        return None
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "is not JSON"
    if isinstance(obj, dict):
        err = obj.get("error")
        return "carries an error object" if isinstance(err, dict | str) and err else None
    return "is not a JSON object" if is_chat(path) else None


def usage_of_json(body: bytes, request_model: str | None) -> Usage:
    """Usage of a JSON response (the response's ``model`` wins over the request's)."""
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return Usage(request_model)
    model = model_of(obj) or request_model
    return usage_from(obj, model) or Usage(model)
