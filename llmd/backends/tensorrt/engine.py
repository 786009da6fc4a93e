"""TensorRT-LLM engine (LLM API, TensorRT-LLM 1.2), written against its documentation.

NOT RUN ON A GPU YET: tensorrt_llm cannot be installed on the machines this was written on.
What runs everywhere, and is tested: the mapping from (choice, model, request) to LLM kwargs
and SamplingParams as plain data, the streaming adapter (against a stand-in with the same
output objects), and the clear error when this backend is selected without tensorrt_llm.
Nothing here imports tensorrt_llm at module load.

How 1.2 is used:
- FP8 on compute capability 8.9+, from a pre-quantized (ModelOpt FP8) checkpoint (its config.json
  has a quantization_config): the PyTorch `LLM`, KV cache in FP8 through KvCacheConfig(dtype="fp8");
  it rejects quant_config. Draft-model speculation (DraftTargetDecodingConfig with the paired HF
  draft folder) and n-gram lookup belong to this backend.
- Anything else (a BF16 checkpoint for FP8, INT8 SmoothQuant on 8.0 to 8.6, INT8 weight-only) is
  quantized and built once with the TensorRT `LLM` (`tensorrt_llm._tensorrt_engine.LLM`) from
  QuantConfig, CalibConfig (a local dataset folder of llmd's prompts) and BuildConfig
  (max_input_len and max_num_tokens from the context), saved with `llm.save(dir)`, and loaded
  from that folder afterwards with nothing but runtime options.
- KV reuse: KvCacheConfig(enable_block_reuse=True, host_cache_size=..., free_gpu_memory_fraction
  low enough to leave a desktop GPU usable); guided decoding through xgrammar.
- Streaming: llm.generate_async(prompt, params, streaming=True); outputs[0].text_diff is new text;
  cancelling aborts the RequestOutput.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from llmd.backends.base import (
    EmbedRequest,
    EmbedResult,
    EngineConfig,
    ErrorEvent,
    Event,
    FinalEvent,
    GenerationRequest,
    TokenEvent,
    Usage,
)
from llmd.backends.profile import Profiler
from llmd.errors import BadRequest, ContextOverflow, EngineError, LlmdError

KV_GPU_FRACTION = 0.6  # TensorRT-LLM's default 0.9 takes most free VRAM; a desktop needs some back
HOST_CACHE_BYTES = 2 * 1024**3
CALIB_FILE = Path(__file__).with_name("calibration_prompts.txt")


def require_tensorrt_llm() -> Any:
    try:
        import tensorrt_llm
    except ImportError as e:
        raise EngineError(
            "the TensorRT backend was selected but tensorrt_llm is not installed: install it with "
            "`pip install 'llmd[tensorrt]' --extra-index-url https://pypi.nvidia.com` on Linux with an NVIDIA GPU "
            f"and CUDA 12, or choose llama.cpp with LLMD_BACKEND=llama.cpp ({e})"
        ) from None
    return tensorrt_llm


def pre_quantized(model_dir: str) -> bool:
    """Whether a Hugging Face checkpoint is already quantized (ModelOpt FP8 and the like): its
    config.json has a quantization_config, or ModelOpt wrote hf_quant_config.json beside it."""
    d = Path(model_dir)
    if (d / "hf_quant_config.json").exists():
        return True
    try:
        config = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("quantization_config"))


def built_engine(engine_dir: str) -> bool:
    """A TensorRT engine folder written by LLM.save (config.json beside rank*.engine)."""
    d = Path(engine_dir)
    return (d / "config.json").exists() and any(d.glob("rank*.engine"))


def calibration_dir(cache: str) -> str:
    """The calibration prompts as a local dataset folder TensorRT-LLM's loader reads.

    The loader (tensorrt_llm.models.convert_utils.load_calib_dataset) calls datasets.load_dataset
    on the folder and picks split and column from a table of known dataset names matched in the
    path: a folder whose name holds "lambada" is read as split "validation", column "text". So
    the prompts go to <cache>/calib-lambada/validation.jsonl, one {"text": ...} per line."""
    d = Path(cache) / "calib-lambada"
    d.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": t}) for t in CALIB_FILE.read_text().splitlines() if t.strip()]
    (d / "validation.jsonl").write_text("\n".join(lines) + "\n")
    return str(d)


DRAFT_LEN = 4  # drafted tokens per step, for both drafters


def speculative_config(mode: str, draft_dir: str | None) -> dict[str, Any] | None:
    """The PyTorch LLM's speculative_config for llmd's speculation mode (fixed when the LLM is
    made: TensorRT-LLM cannot change it per request). auto: the paired draft model when there is
    one; n-gram lookup only when asked for (its drafts cost verification on every reply)."""
    if mode in ("draft", "auto") and draft_dir:
        return {"__class__": "DraftTargetDecodingConfig", "max_draft_len": DRAFT_LEN, "speculative_model": draft_dir}
    if mode == "ngram":
        return {"__class__": "NGramDecodingConfig", "max_draft_len": DRAFT_LEN, "max_matching_ngram_size": 3}
    return None


def speculation_notes(mode: str, draft_dir: str | None, what: str) -> list[str]:
    """Why a TensorRT engine runs without the speculation asked for, and how to get it."""
    if mode == "off" or (mode == "auto" and not draft_dir):
        return []
    asked = "the paired draft model" if mode in ("draft", "auto") and draft_dir else f"speculation {mode!r}"
    return [f"{asked} does not apply to {what}: it was built without speculation, and a built engine takes "
            "only Lookahead, Medusa or Eagle. Rebuild it with Lookahead (trtllm-build --speculative_decoding_mode "
            "lookahead_decoding --max_draft_len 4), or serve a ModelOpt FP8 checkpoint on the PyTorch LLM, which "
            "takes draft-model and n-gram speculation"]


def engine_limits(engine_dir: str, cfg: EngineConfig) -> tuple[int, int]:
    """(max_seq_len, max_input_len) a built engine enforces, from its config.json (LLM.save and
    trtllm-build write build_config there); the context llmd gave the LLM otherwise."""
    try:
        build = json.loads((Path(engine_dir) / "config.json").read_text()).get("build_config") or {}
    except (OSError, ValueError):
        build = {}
    seq = int(build.get("max_seq_len") or cfg.n_ctx)
    return seq, int(build.get("max_input_len") or seq)


def llm_kwargs(precision: str, model_dir: str, cfg: EngineConfig, engine_dir: str,
               speculation: str = "off", draft_dir: str | None = None, quantized: bool = False,
               calib_dir: str | None = None, built: bool = False) -> tuple[str, dict[str, Any], list[str]]:
    """Which LLM class to use ("pytorch", "engine" to build, or "built" to load a built engine),
    its keyword arguments as data, and notes for doctor and status (a pairing that cannot apply).
    Objects (KvCacheConfig, QuantConfig, ...) are described as {"__class__": name, **fields}."""
    notes: list[str] = []
    kv = {"__class__": "KvCacheConfig", "enable_block_reuse": True, "host_cache_size": HOST_CACHE_BYTES,
          "free_gpu_memory_fraction": KV_GPU_FRACTION}
    # guided decoding (JSON output) needs its backend named on the LLM, or JSON requests fail
    if built:
        # a built engine carries its own quantization and build limits: only runtime options go with it
        notes += speculation_notes(speculation, draft_dir, "a prebuilt TensorRT engine")
        return "built", {"model": engine_dir, "kv_cache_config": kv, "guided_decoding_backend": "xgrammar"}, notes
    max_num_tokens = min(8192, cfg.n_ctx * cfg.n_slots)
    common: dict[str, Any] = {"model": model_dir, "max_batch_size": cfg.n_slots, "max_seq_len": cfg.n_ctx,
                              "max_num_tokens": max_num_tokens, "kv_cache_config": kv,
                              "guided_decoding_backend": "xgrammar"}
    if precision == "fp8" and quantized:
        kv["dtype"] = "fp8"
        spec = speculative_config(speculation, draft_dir)
        if spec is not None:
            common["speculative_config"] = spec
            common["disable_overlap_scheduler"] = True  # the two-model and n-gram drafters need it off
        elif speculation == "draft":
            notes.append("speculation 'draft' asked for, but no draft model with a Hugging Face folder is paired "
                         "(`llmd models add DRAFT_FOLDER --name DRAFT`, then `llmd models pair TARGET DRAFT`)")
        return "pytorch", common, notes
    algo = {"fp8": "FP8", "int8": "W8A8_SQ_PER_CHANNEL", "int8-weight-only": "W8A16"}.get(precision)
    if algo is None:
        raise EngineError(f"TensorRT precision {precision!r} is not one of fp8, int8, int8-weight-only")
    notes += speculation_notes(speculation, draft_dir, "the TensorRT engine this checkpoint is quantized into")
    common["quant_config"] = {"__class__": "QuantConfig", "quant_algo": algo,
                              "kv_cache_quant_algo": "FP8" if precision == "fp8" else "INT8"}
    if precision != "int8-weight-only":  # weight-only needs no activation statistics
        common["calib_config"] = {"__class__": "CalibConfig", "calib_dataset": calib_dir or "",
                                  "calib_batches": 64, "calib_max_seq_length": 512}
    common["build_config"] = {"__class__": "BuildConfig", "max_batch_size": cfg.n_slots, "max_seq_len": cfg.n_ctx,
                              "max_input_len": cfg.n_ctx - 1, "max_num_tokens": max_num_tokens}
    return "engine", common, notes


def sampling_kwargs(req: GenerationRequest, room: int) -> dict[str, Any]:
    """SamplingParams for a request. max_tokens is always set (TensorRT-LLM's default is 32), to
    what the request asked or the room its prompt leaves in the context."""
    s = req.sampling
    kw: dict[str, Any] = {
        "max_tokens": min(req.max_tokens, room) if req.max_tokens is not None else room,  # an upper bound
        "temperature": s.temperature,
        "return_perf_metrics": True,
    }
    if s.greedy:
        kw["top_k"] = 1  # with neither top_k nor top_p set TensorRT-LLM decodes greedily anyway; say it
    else:
        kw["top_p"] = s.top_p  # also 1.0: without top_p or top_k it would decode greedily
        if s.top_k > 0:
            kw["top_k"] = s.top_k
        if s.min_p > 0:
            kw["min_p"] = s.min_p
    if s.seed is not None:
        kw["seed"] = s.seed
    if s.presence_penalty:
        kw["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        kw["frequency_penalty"] = s.frequency_penalty
    if s.repeat_penalty != 1.0:
        kw["repetition_penalty"] = s.repeat_penalty
    if req.stop:
        kw["stop"] = list(req.stop)
    rf = req.response_format
    if rf and rf.get("type") == "json_object":
        kw["guided_decoding"] = {"__class__": "GuidedDecodingParams", "json_object": True}
    elif rf and rf.get("type") == "json_schema":
        kw["guided_decoding"] = {"__class__": "GuidedDecodingParams", "json": rf["json_schema"]["schema"]}
    return kw


def materialize(value: Any, namespace: dict[str, Any]) -> Any:
    """Turn the {"__class__": ...} descriptions into tensorrt_llm objects."""
    if isinstance(value, dict) and "__class__" in value:
        cls = namespace[value["__class__"]]
        return cls(**{k: materialize(v, namespace) for k, v in value.items() if k != "__class__"})
    if isinstance(value, dict):
        return {k: materialize(v, namespace) for k, v in value.items()}
    if isinstance(value, str) and value in namespace.get("_enums", {}):
        return namespace["_enums"][value]
    return value


async def stream_events(request_id: str, outputs: AsyncIterator[Any], t_received: float) -> AsyncIterator[Event]:
    """Adapt generate_async(streaming=True) outputs to llmd events. Each output has
    outputs[0].text_diff (new text), .token_ids, .finish_reason, and prompt_token_ids;
    request_perf_metrics.speculative_decoding carries draft figures when speculation is on."""
    t_first = 0.0
    async for out in outputs:
        o = out.outputs[0]
        if o.text_diff:
            if not t_first:
                t_first = time.perf_counter()
            yield TokenEvent(request_id, o.text_diff, 1)
        if out.finished:
            now = time.perf_counter()
            spec = getattr(getattr(o, "request_perf_metrics", None), "speculative_decoding", None)
            drafted = int(getattr(spec, "total_draft_tokens", 0) or 0)
            accepted = int(getattr(spec, "total_accepted_draft_tokens", 0) or 0)
            usage = Usage(
                prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(o.token_ids), cached_tokens=0,
                ttft_s=(t_first or now) - t_received, prefill_s=(t_first or now) - t_received,
                decode_s=now - (t_first or now), drafted_tokens=drafted, accepted_tokens=accepted)
            yield FinalEvent(request_id, "length" if o.finish_reason == "length" else "stop", usage)
            return


class TensorRTEngine:
    name = "tensorrt"
    supports_speculation = True
    supports_prefix_cache = True  # KV block reuse inside TensorRT-LLM
    precisions = ("fp8", "int8")

    def __init__(self, cfg: EngineConfig) -> None:
        trt = require_tensorrt_llm()
        from tensorrt_llm import SamplingParams  # noqa: F401  (checked here, used in _generate)

        self.cfg = cfg
        self._trt = trt
        self.profiler = Profiler(False)
        self.interrupt: Any = None  # the worker sets it; TensorRT-LLM runs its own loop and ignores it
        self._events: queue.Queue[Event] = queue.Queue()
        self._active: dict[str, asyncio.Task[None]] = {}
        self._outputs: dict[str, Any] = {}  # request id -> its RequestOutput, to abort it
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="llmd-trt-loop", daemon=True)
        self._thread.start()
        t0 = time.perf_counter()
        self.notes: list[str] = []
        self.speculation = "off"
        self.max_seq_len = self.max_input_len = cfg.n_ctx
        # the LLM must be created inside the running event loop
        self.llm = asyncio.run_coroutine_threadsafe(self._create(), self._loop).result()
        self.load_s = time.perf_counter() - t0

    def _engine_dir(self) -> str:
        cache = Path(self.cfg.prefix_dir or ".").parent / "trt-engines"
        return str(cache / f"{self.cfg.model_digest or self.cfg.model_name}-{self.cfg.precision or 'fp8'}")

    async def _create(self) -> Any:
        from tensorrt_llm import llmapi

        precision = self.cfg.precision or "fp8"
        engine_dir = self.cfg.model_path if built_engine(self.cfg.model_path) else self._engine_dir()
        built = built_engine(engine_dir)
        calib = None if built or pre_quantized(self.cfg.model_path) else calibration_dir(str(Path(engine_dir).parent))
        kind, kwargs, self.notes = llm_kwargs(precision, self.cfg.model_path, self.cfg, engine_dir,
                                              speculation=self.cfg.speculation, draft_dir=self.cfg.draft_path or None,
                                              quantized=pre_quantized(self.cfg.model_path), calib_dir=calib,
                                              built=built)
        spec = kwargs.get("speculative_config")
        self.speculation = {"NGramDecodingConfig": "ngram", "DraftTargetDecodingConfig": "draft"}.get(
            spec["__class__"], "off") if spec else "off"
        ns = {name: getattr(llmapi, name) for name in dir(llmapi) if not name.startswith("_")}
        if kind == "pytorch":
            from tensorrt_llm import LLM
        else:  # building an engine, or loading one built before: the TensorRT LLM class, nothing else
            from tensorrt_llm._tensorrt_engine import LLM
            from tensorrt_llm.quantization import QuantAlgo

            ns["_enums"] = {k: getattr(QuantAlgo, k) for k in ("FP8", "W8A8_SQ_PER_CHANNEL", "W8A16", "INT8")}
        llm = LLM(**materialize(kwargs, ns))
        if kind == "engine":  # built once; later loads take the saved engine
            await asyncio.to_thread(llm.save, engine_dir)
        self.max_seq_len, self.max_input_len = (engine_limits(engine_dir, self.cfg) if kind != "pytorch"
                                                else (self.cfg.n_ctx, self.cfg.n_ctx))
        return llm

    def info(self) -> dict[str, Any]:
        return {"engine": self.name, "model": self.cfg.model_name, "path": self.cfg.model_path,
                "precision": self.cfg.precision, "n_ctx": self.cfg.n_ctx, "n_slots": self.cfg.n_slots,
                "load_s": round(self.load_s, 3), "tensorrt_llm": getattr(self._trt, "__version__", "?"),
                "max_seq_len": self.max_seq_len, "max_input_len": self.max_input_len,
                # fixed when the LLM was made: a request's own `speculation` cannot change it here
                "speculation": {"mode": self.speculation, "asked": self.cfg.speculation, "per_request": False},
                "notes": self.notes, "pid": os.getpid()}

    @classmethod
    def preload(cls) -> None:
        """A standby worker imports tensorrt_llm ahead of its model (seconds saved at the switch)."""
        try:
            require_tensorrt_llm()
        except EngineError:
            pass  # reported when a model is loaded

    def _prompt_ids(self, req: GenerationRequest) -> list[int]:
        """The token ids TensorRT-LLM gets, so llmd counts exactly what it sees. A chat is rendered
        with the checkpoint's template, which writes BOS itself: encoded without special tokens,
        or the model would see BOS twice (as TensorRT-LLM's own server does it). A raw prompt gets
        the tokenizer's BOS, as generate_async would add to a string."""
        if req.fim is not None:  # its prompt would be empty: refused, never answered as if it were the code
            raise BadRequest("the TensorRT-LLM engine does not fill in the middle; serve completions with a "
                             "GGUF FIM model on llama.cpp (LLMD_BACKEND=llama.cpp)", "suffix")
        tok = self.llm.tokenizer
        if req.raw or req.messages is None:
            return list(tok.encode(req.prompt or "", add_special_tokens=True))
        text = tok.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))

    def submit(self, req: GenerationRequest) -> None:
        t = time.perf_counter()
        fut = asyncio.run_coroutine_threadsafe(self._generate(req, t), self._loop)
        fut.add_done_callback(lambda _f: (self._active.pop(req.id, None), self._outputs.pop(req.id, None)))

    def _refuse(self, req: GenerationRequest) -> LlmdError | None:
        if req.tools and req.tool_choice != "none":
            return BadRequest(f"{self.cfg.model_name} runs on TensorRT-LLM, where llmd does not do tool calls yet; "
                              "use a GGUF model (llama.cpp) for tools", "tools")
        if req.top_logprobs is not None:
            return BadRequest(f"{self.cfg.model_name} runs on TensorRT-LLM, where llmd does not report logprobs "
                              "yet", "logprobs")
        return None

    async def _generate(self, req: GenerationRequest, t_received: float) -> None:
        from tensorrt_llm import SamplingParams, llmapi

        self._active[req.id] = asyncio.current_task()  # type: ignore[assignment]
        try:
            refused = self._refuse(req)
            if refused is not None:
                raise refused
            ids = self._prompt_ids(req)
            limit = min(self.max_input_len, self.max_seq_len - 1)
            if len(ids) > limit:
                raise ContextOverflow(
                    f"the prompt is {len(ids)} tokens but this TensorRT engine takes at most {limit} "
                    f"(max_seq_len {self.max_seq_len}, max_input_len {self.max_input_len}): shorten the prompt, or "
                    "rebuild the engine for a longer context (LLMD_CTX)",
                    "messages" if req.messages is not None else "prompt")
            # max_tokens: at most the room TensorRT-LLM checks (prompt + max_tokens <= max_seq_len)
            room = self.max_seq_len - len(ids)
            ns = {name: getattr(llmapi, name) for name in dir(llmapi) if not name.startswith("_")}
            params = SamplingParams(**materialize(sampling_kwargs(req, room), ns))
            output = self.llm.generate_async(ids, params, streaming=True)
            self._outputs[req.id] = output
            async for ev in stream_events(req.id, output, t_received):
                self._events.put(ev)
        except asyncio.CancelledError:
            self._events.put(FinalEvent(req.id, "cancelled", Usage(0, 0, 0, 0.0, 0.0, 0.0)))
        except LlmdError as e:
            self._events.put(ErrorEvent(req.id, e.to_wire()))
        except Exception as e:
            self._events.put(ErrorEvent(req.id, EngineError(f"TensorRT-LLM failed: {e}").to_wire()))

    def embed(self, req: EmbedRequest) -> EmbedResult:
        raise BadRequest(f"{self.cfg.model_name} runs on TensorRT-LLM, which llmd does not embed with yet; "
                         "use a GGUF model for embeddings", "model")

    def cancel(self, request_id: str) -> None:
        """Abort the request inside TensorRT-LLM (its RequestOutput), then end our task: cancelling
        only the task would leave the request generating on the GPU."""
        output = self._outputs.get(request_id)
        if output is not None:
            self._loop.call_soon_threadsafe(output.abort)
        task = self._active.get(request_id)
        if task is not None:
            self._loop.call_soon_threadsafe(task.cancel)

    def has_work(self) -> bool:
        return bool(self._active) or not self._events.empty()

    def step(self) -> list[Event]:
        out: list[Event] = []
        try:
            out.append(self._events.get(timeout=0.02))
            while True:
                out.append(self._events.get_nowait())
        except queue.Empty:
            pass
        return out

    def stats(self) -> dict[str, Any]:
        return {"slots_busy": len(self._active), "slots": self.cfg.n_slots, "waiting": 0}

    def clear_caches(self) -> dict[str, Any]:
        return {"prefixes_cleared": 0, "namespace": ""}  # TensorRT-LLM's KV reuse lives and ends with the LLM

    def close(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(asyncio.to_thread(self.llm.shutdown), self._loop).result(60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
