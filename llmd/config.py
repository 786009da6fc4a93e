"""All of llmd's settings: one table of name, type, default, env var and description.

Settings resolve once, in this order: built-in default < environment (LLMD_*) < explicit
overrides (command-line flags). LLMD_HOME, when set, puts every data, config, cache and log
dir under one folder; otherwise platformdirs picks the user's usual places.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

import platformdirs

APP = "llmd"


_TYPES = {"str": str, "int": int, "float": float, "bool": bool}


@dataclass(frozen=True)
class Setting:
    """One row of the settings table: its name and what it does. Its type and default are the
    Settings dataclass field's, so they are written once."""

    name: str
    help: str

    @property
    def env(self) -> str:
        return "LLMD_" + self.name.upper()

    @property
    def type(self) -> type:
        return _TYPES[str(_FIELDS[self.name].type)]

    @property
    def default(self) -> Any:
        return _FIELDS[self.name].default


def _parse(setting: Setting, raw: str) -> Any:
    if setting.type is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{setting.env}={raw!r} is not a boolean; use 1 or 0")
    try:
        return setting.type(raw)
    except ValueError:
        raise ValueError(f"{setting.env}={raw!r} is not a valid {setting.type.__name__}") from None


@dataclass(frozen=True)
class Paths:
    data: Path
    config: Path
    cache: Path
    logs: Path

    @classmethod
    def resolve(cls, home: str) -> Paths:
        if home:
            root = Path(home).expanduser()
            return cls(root / "data", root / "config", root / "cache", root / "logs")
        return cls(
            Path(platformdirs.user_data_dir(APP)),
            Path(platformdirs.user_config_dir(APP)),
            Path(platformdirs.user_cache_dir(APP)),
            Path(platformdirs.user_log_dir(APP)),
        )

    def ensure(self) -> None:
        """Make the folders, private to the user (0700): they hold prompts' token ids and the token."""
        for p in (self.data, self.config, self.cache, self.logs):
            p.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                os.chmod(p, 0o700)
            except OSError:
                pass
            if not os.access(p, os.W_OK):
                raise ValueError(f"llmd cannot write to {p}: make it writable by this user, or point LLMD_HOME "
                                 "at a folder that is")
        self._migrate()

    def _migrate(self) -> None:
        """Files renamed since they were written: moved once, with SQLite's -wal and -shm beside them."""
        for old, new in ((self.cache / "responses.db", self.response_cache_db),):
            if old.exists() and not new.exists():
                for suffix in ("", "-wal", "-shm"):
                    src = old.with_name(old.name + suffix)
                    if src.exists():
                        src.rename(new.with_name(new.name + suffix))

    @property
    def registry_db(self) -> Path:
        return self.data / "registry.db"

    @property
    def responses_api_db(self) -> Path:
        """The Responses API's stored responses (previous_response_id, GET /v1/responses/ID): data."""
        return self.data / "responses_api.db"

    @property
    def models_dir(self) -> Path:
        return self.data / "models"

    @property
    def response_cache_db(self) -> Path:
        """The response cache (replies replayed for repeated requests): cache, safe to delete."""
        return self.cache / "response_cache.db"

    @property
    def prefix_dir(self) -> Path:
        return self.cache / "prefix"

    @property
    def prefix_key(self) -> Path:
        """The HMAC key of the prefix cache's entries: in the config folder, apart from what it signs."""
        return self.config / "prefix-cache.key"

    @property
    def repack_record(self) -> Path:
        return self.data / "repack.json"

    @property
    def pid_file(self) -> Path:
        return self.data / "llmd.pid"

    @property
    def log_file(self) -> Path:
        return self.logs / "llmd.log"


@dataclass(frozen=True)
class Settings:
    home: str = ""
    host: str = "127.0.0.1"
    port: int = 11435
    model: str = "smollm2-135m"
    ctx: str = "auto"
    ctx_start: int = 8192  # with ctx auto: tokens per slot a model starts with, grown by use
    slots: int = 4
    threads: str = "auto"
    chunk: int = 64
    exact: bool = False
    prefill_budget: int = 128
    min_share: float = 0.2  # of the CPU, for a class held back by a higher one (cpu_board.Turns)
    max_queue: int = 64
    max_body: int = 8 * 1024 * 1024
    backend: str = "auto"
    gpu_layers: int = -1
    preload: bool = True
    allowed_origins: str = ""
    keep_alive: str = "5m"
    max_loaded: int = 0  # 0: by memory
    standby: bool = True
    profile: bool = False
    response_cache: bool = True
    response_cache_ttl: float = 3600.0
    response_cache_mb: int = 256
    prefix_cache_mb: int = 2048
    responses_store_mb: int = 256
    prefix_ram_mb: int = 512
    prefix_min_tokens: int = 256
    speculation: str = "auto"
    draft: str = ""
    auto_draft: bool = True
    repack: str = "auto"
    flash_attn: str = "auto"
    kl_warn: float = 0.05
    hang_s: float = 120.0
    load_timeout_s: float = 600.0
    max_queue_model: int = 32
    remote_read_s: float = 120.0
    remote_first_token_s: float = 600.0
    test_crash: str = ""
    test_slow_prefix_read: float = 0.0
    paths: Paths = field(default=None, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.paths is None:
            object.__setattr__(self, "paths", Paths.resolve(self.home))

    @property
    def base_url(self) -> str:
        host = self.host if self.host not in ("0.0.0.0", "::") else "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "paths"}
        out["paths"] = {k: str(v) for k, v in vars(self.paths).items()}
        return out


SETTINGS: tuple[Setting, ...] = (
    Setting("home", "one folder for all data, config, cache and logs (default: platformdirs)"),
    Setting("host", "address to listen on; loopback only unless you mean it"),
    Setting("port", "TCP port of the HTTP API"),
    Setting("model", "model loaded at start and used when a request names none"),
    Setting("ctx", "context length (tokens) each slot can hold: auto (the model's trained context, less "
            "when a quarter of the free memory cannot hold it for every slot) or a number"),
    Setting("ctx_start", "with LLMD_CTX=auto: the context each slot starts with; a prompt that needs more "
            "loads the model again with a larger one, up to the automatic choice (0: start there)"),
    Setting("slots", "concurrent sequences in one context (requests decoded together)"),
    Setting("threads", "CPU threads for llama.cpp: auto (up to the physical cores, fewer while other "
            "programs keep cores busy; docs/HOW_IT_WORKS.md: A busy machine) or a fixed number"),
    Setting("chunk", "prefix-cache block, and the exact policy's prefill chunk, in tokens"),
    Setting("exact", "the exact batching policy: the same greedy output whatever is cached or running, "
            "at a latency cost (docs/USAGE.md: Two batching policies); default: the fast policy"),
    Setting("prefill_budget", "prompt tokens prefilled per step while other streams decode (fast policy; "
            "with nothing else running a prompt goes in batches of 512)"),
    Setting("min_share", "the least share of the CPU a model's requests get while another model's more "
            "urgent ones run (an agent's prompt while an editor's completions keep coming): 0 to 0.5; "
            "background work (embeddings, titles) gets a quarter of it; 0 runs strictly by class"),
    Setting("max_queue", "requests waiting for a slot before the API answers 503"),
    Setting("max_body", "largest request body accepted, in bytes"),
    Setting("backend", "engine: auto (probe the machine), llama.cpp or tensorrt"),
    Setting("gpu_layers", "llama.cpp layers on the GPU (-1: as many as the backend choice fits)"),
    Setting("preload", "load the default model when the daemon starts"),
    Setting("allowed_origins", "comma-separated browser origins allowed besides loopback ones"),
    Setting("keep_alive", "unload a model idle this long (Ollama style: 30s, 5m, 1h, -1 = never)"),
    Setting("max_loaded", "models kept loaded at once: 0 (the default) keeps every model used while memory allows "
            "(a load that needs room unloads the least recently used idle model first); N caps the count"),
    Setting("response_cache", "answer repeated deterministic requests from the SQLite response cache"),
    Setting("response_cache_ttl", "seconds a cached response stays valid"),
    Setting("response_cache_mb", "size bound of the response cache, MiB (least recently used go first)"),
    Setting("prefix_cache_mb", "size bound of the on-disk prompt-prefix KV cache, MiB (0 turns it off)"),
    Setting("responses_store_mb", "size bound of the Responses API's stored conversations "
            "(previous_response_id), MiB: past it the oldest go first"),
    Setting("prefix_ram_mb", "in-memory tier of the prefix cache: recently evicted sequences, MiB"),
    Setting("prefix_min_tokens", "save a prompt's KV to disk when it has at least this many tokens"),
    Setting("profile", "record per-step engine timing, shown by /llmd/status and `llmd status --verbose`"),
    Setting("speculation", "default speculation for requests that name none: auto (cost-aware), "
            "ngram, draft or off (bit-exact; docs/HOW_IT_WORKS.md)"),
    Setting("draft", "draft models as TARGET=DRAFT pairs, comma-separated (like `llmd models pair`)"),
    Setting("auto_draft", "pair a registered model that shares a target's vocabulary at half its size or "
            "less as its draft model, when none is paired (`llmd models pair T --none` refuses one)"),
    Setting("repack", "llama.cpp weight repacking (AMX and other CPU layouts): auto (on unless it "
            "crashed on this CPU before; see `llmd doctor`), on or off"),
    Setting("flash_attn", "the attention kernel: auto attends by matrix products on the CPU under the fast "
            "policy (faster past a few hundred tokens of context, benchmarks/attention.py) and keeps "
            "llama.cpp's flash attention under the exact policy and on a GPU; on keeps flash attention "
            "everywhere (as llama-server); off is auto"),
    Setting("kl_warn", "`llmd eval` warns when the KL divergence from the base model is above this"),
    Setting("standby", "keep one worker process started ahead, so loads and switches skip its start"),
    Setting("remote_read_s", "a remote model's upstream that sends nothing this many seconds in a reply is cut "
            "off: the reply ends with an error naming it, and it is marked down"),
    Setting("remote_first_token_s", "a remote model's upstream whose reply has not started after this many seconds "
            "(a long prompt, a queue) is given up on for this request, and not marked down"),
    Setting("hang_s", "a worker with requests open that sends nothing (not even its heartbeat) this many "
            "seconds is stopped and replaced; its requests get an error"),
    Setting("load_timeout_s", "a model load that takes longer is stopped: its requests get 503 with the "
            "reason, and the model is not started again until asked for (`llmd use`)"),
    Setting("max_queue_model", "requests one model may hold (running, queued or waiting for its load) "
            "before its new ones get 503, so one slow model cannot take every admission"),
    # read by the worker processes from their environment (they inherit the daemon's)
    Setting("test_crash", "FOR TESTS ONLY: make a worker fail as a fault would: repack or always (SIGSEGV at "
            "the first multi-token decode, as the AMX repack crash), hang or raise (a long prompt's decode "
            "never returns, or raises), hang-load (a load that never returns)"),
    Setting("test_slow_prefix_read", "FOR TESTS ONLY: seconds each prefix-cache disk read waits first"),
)

_FIELDS = {f.name: f for f in fields(Settings)}
_BY_NAME = {s.name: s for s in SETTINGS}
assert set(_BY_NAME) == set(_FIELDS) - {"paths"}, "every Settings field needs a row in SETTINGS"


def load_settings(overrides: dict[str, Any] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Resolve settings from defaults, LLMD_* environment variables and explicit overrides."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for s in SETTINGS:
        if s.env in env:
            values[s.name] = _parse(s, env[s.env])
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k not in _BY_NAME:
            raise KeyError(f"unknown setting {k!r}")
        values[k] = v
    settings = Settings(**values)
    parse_duration(settings.keep_alive)  # fail at start, not at the first unload
    if settings.backend not in ("auto", "llama.cpp", "tensorrt"):
        raise ValueError(f"LLMD_BACKEND={settings.backend!r}: use auto, llama.cpp or tensorrt")
    if settings.speculation not in SPECULATION_MODES:
        raise ValueError(f"LLMD_SPECULATION={settings.speculation!r}: use {', '.join(SPECULATION_MODES)}")
    draft_pairs(settings.draft)  # fail at start on a malformed pair list
    fixed_threads(settings.threads)
    fixed_ctx(settings.ctx)
    if settings.repack not in ("auto", "on", "off"):
        raise ValueError(f"LLMD_REPACK={settings.repack!r}: use auto, on or off")
    if settings.flash_attn not in ("auto", "on", "off"):
        raise ValueError(f"LLMD_FLASH_ATTN={settings.flash_attn!r}: use auto, on or off")
    if not 0.0 <= settings.min_share <= 0.5:
        raise ValueError(f"LLMD_MIN_SHARE={settings.min_share}: use a share from 0 (strictly by class) to 0.5")
    if settings.ctx_start < 0:
        raise ValueError(f"LLMD_CTX_START={settings.ctx_start}: use 0 (start at the automatic context) or tokens per slot")
    if settings.max_loaded < 0:
        raise ValueError(f"setting max_loaded must be 0 (by memory) or a count, got {settings.max_loaded}")
    for name in ("port", "slots", "chunk", "max_queue", "max_body", "prefill_budget",
                 "load_timeout_s", "max_queue_model"):
        if getattr(settings, name) <= 0:
            raise ValueError(f"setting {name} must be positive, got {getattr(settings, name)}")
    return settings


def fixed_threads(value: str) -> int:
    """LLMD_THREADS as the engine's `threads`: 0 for auto (chosen while running), else the fixed count."""
    text = value.strip().lower()
    if text in ("auto", "0", ""):
        return 0
    if text.isdigit():
        return int(text)
    raise ValueError(f"LLMD_THREADS={value!r}: use auto or a number of threads (e.g. 2)")


def fixed_ctx(value: str | int) -> int:
    """LLMD_CTX as tokens per slot: 0 for auto (chosen from the model and the memory at load)."""
    text = str(value).strip().lower()
    if text in ("auto", "0", ""):
        return 0
    if text.isdigit():
        return int(text)
    raise ValueError(f"LLMD_CTX={value!r}: use auto or a number of tokens per slot (e.g. 8192)")


SpeculationMode = Literal["auto", "off", "ngram", "draft"]
SPECULATION_MODES: tuple[str, ...] = get_args(SpeculationMode)


def draft_pairs(value: str) -> dict[str, str]:
    """LLMD_DRAFT "target=draft,target2=draft2" as a mapping; ValueError naming a bad item."""
    pairs = {}
    for item in filter(None, (i.strip() for i in value.split(","))):
        target, sep, draft = (p.strip() for p in item.partition("="))
        if not sep or not target or not draft:
            raise ValueError(f"LLMD_DRAFT item {item!r} is not TARGET=DRAFT (e.g. smollm2-f16=smollm2-135m)")
        pairs[target] = draft
    return pairs


MAX_DURATION_S = 100 * 31_536_000  # a keep_alive past this is meant as forever: -1 says so
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str | float | int | None) -> float | None:
    """Ollama-style keep_alive: seconds as a number, or "300ms", "30s", "5m", "1h"; negative means
    forever (None). Raises ValueError naming the value otherwise."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"keep_alive {value!r} is not a duration; use seconds or 30s, 5m, 1h, -1")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip().lower()
        for unit in sorted(_UNITS, key=len, reverse=True):
            if text.endswith(unit) and text[: -len(unit)].strip().lstrip("-").replace(".", "", 1).isdigit():
                seconds = float(text[: -len(unit)]) * _UNITS[unit]
                break
        else:
            try:
                seconds = float(text)
            except ValueError:
                raise ValueError(f"keep_alive {value!r} is not a duration; use seconds or 30s, 5m, 1h, -1") from None
    if not math.isfinite(seconds):  # NaN, inf, 1e400: would poison every expiry computed from it
        raise ValueError(f"keep_alive {value!r} is not a finite duration; use seconds or 30s, 5m, 1h, -1 (forever)")
    if seconds > MAX_DURATION_S:  # 1e308 s is finite, but no clock or date can hold now + it
        raise ValueError(f"keep_alive {value!r} is {seconds:.3g} s, more than {MAX_DURATION_S // 31_536_000:.0f} "
                         "years; use -1 to keep the model loaded forever")
    return None if seconds < 0 else seconds


def describe() -> str:
    """The settings table, for --help and `llmd doctor`."""
    return "\n".join(f"  {s.env:<22} {s.help} (default: {s.default!r})" for s in SETTINGS)
