"""Pulling GGUF models from the Hugging Face Hub: which file a reference names, and downloading it.

A reference is `USER/REPO[:QUANT]`, `USER/REPO/FILE.gguf`, or either behind `hf.co/` or
`huggingface.co/` (as Ollama accepts). The repo's file list comes from huggingface_hub (so
HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE apply); the quantization asked for (default Q4_K_M) is
picked, else the closest one the repo has, and the caller is told which. A split GGUF
(`-00001-of-0000N`) is downloaded whole; llama.cpp loads it from its first part. Projector files
(`mmproj`) are noted, not downloaded: llmd serves text only for now.

Downloads resume: huggingface_hub's own download drops a partial file when interrupted, so each
file is fetched here into `FILE.part` with HTTP Range from where the last attempt stopped, on the
URL and headers huggingface_hub gives, then checked against the sha256 the Hub lists before it is
renamed into place. Nothing is registered until every file is in place and checked.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmd.errors import BadRequest, InsufficientStorage, ModelNotFound, UpstreamError
from llmd.models.digest import file_digest

DEFAULT_QUANT = "Q4_K_M"
# from the most bits to the fewest: "closest" is the nearest in this order
QUANT_ORDER = ("F32", "BF16", "F16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S",
               "IQ4_NL", "IQ4_XS", "Q4_1", "Q4_0", "Q3_K_L", "Q3_K_M", "Q3_K_S", "IQ3_M", "IQ3_XS", "IQ3_XXS",
               "Q2_K", "IQ2_M", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")
_QUANT_RE = re.compile(r"(?<![A-Za-z0-9])(" + "|".join(sorted(QUANT_ORDER, key=len, reverse=True)) + r")(?![A-Za-z0-9])",
                       re.IGNORECASE)
_SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# a user, repo or file name as the Hub allows them (no "..", no "--" at the ends, no separators)
_PART_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
PART = ".part"


@dataclass(frozen=True)
class HubRef:
    repo: str
    quant: str | None = None  # asked for; None: the default
    filename: str | None = None  # an exact file, instead of a quantization

    @property
    def origin(self) -> str:
        """The reference as Ollama clients write it, which then names the model too."""
        return f"hf.co/{self.repo}/{self.filename}" if self.filename else f"hf.co/{self.repo}:{self.quant or DEFAULT_QUANT}"


@dataclass
class HubFile:
    name: str
    size: int
    sha256: str | None


@dataclass
class PullPlan:
    ref: HubRef
    revision: str  # the commit every file is fetched at
    quant: str
    files: list[HubFile]  # one, or every part of a split GGUF, in order
    name: str  # the name it is registered under
    notes: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def is_hub_ref(name: str) -> bool:
    return name.lower().startswith(("hf.co/", "huggingface.co/"))


def parse_ref(text: str) -> HubRef:
    """`USER/REPO[:QUANT]`, `USER/REPO/FILE.gguf`, optionally behind hf.co/ or huggingface.co/."""
    t = text.strip()
    for prefix in ("https://", "http://"):
        t = t.removeprefix(prefix)
    low = t.lower()
    for host in ("hf.co/", "huggingface.co/"):
        if low.startswith(host):
            t = t[len(host):]
            break
    repo, _, quant = t.partition(":")
    parts = repo.strip("/").split("/")
    # every part checked, the file name too: "../etc/x.gguf" must not reach the Hub client or a path
    valid = all(_PART_RE.fullmatch(p) and ".." not in p for p in parts)
    if valid and len(parts) == 3 and parts[2].lower().endswith(".gguf") and not quant:
        return HubRef(f"{parts[0]}/{parts[1]}", filename=parts[2])
    if len(parts) != 2 or not valid or (quant and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_-]*", quant)):
        raise BadRequest(f"{text!r} is not a Hugging Face model reference: give USER/REPO[:QUANT] (e.g. "
                         "bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M) or USER/REPO/FILE.gguf", "model")
    if quant and quant.lower() == "latest":
        quant = ""
    return HubRef(repo, quant.upper() or None)


def quant_of(filename: str) -> str | None:
    m = _QUANT_RE.search(Path(filename).name)
    return m.group(1).upper() if m else None


def model_name(ref: HubRef, quant: str) -> str:
    """`qwen2.5-0.5b-instruct:q4_k_m` for bartowski/Qwen2.5-0.5B-Instruct-GGUF and Q4_K_M."""
    base = ref.repo.split("/", 1)[1]
    base = re.sub(r"[-_.]gguf$", "", base, flags=re.IGNORECASE).lower()
    return f"{base}:{quant.lower()}"


def plan(ref: HubRef, api: Any = None) -> PullPlan:
    """Which files to fetch for `ref`, at which commit, under which name."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError

    api = api or HfApi()
    try:
        info = api.model_info(ref.repo, files_metadata=True)
    except RepositoryNotFoundError as e:
        raise ModelNotFound(f"the Hugging Face Hub has no model {ref.repo!r} (or it is private: set HF_TOKEN)",
                            "model") from e
    except OfflineModeIsEnabled as e:
        raise UpstreamError(f"cannot pull {ref.repo}: HF_HUB_OFFLINE is set; unset it to download") from e
    except (HfHubHTTPError, OSError) as e:
        raise UpstreamError(f"the Hugging Face Hub could not list {ref.repo}: {e}") from e
    except Exception as e:  # huggingface_hub's validation errors, its HTTP client's network errors
        raise UpstreamError(f"the Hugging Face Hub could not list {ref.repo} ({type(e).__name__}: {e}); check "
                            "HF_ENDPOINT and the network, then pull again") from e
    files = {s.rfilename: HubFile(s.rfilename, int(s.size or (s.lfs.size if s.lfs else 0) or 0),
                                  s.lfs.sha256 if s.lfs else None) for s in info.siblings or []}
    ggufs = [n for n in files if n.lower().endswith(".gguf")]
    projectors = [n for n in ggufs if "mmproj" in Path(n).name.lower()]
    models = [n for n in ggufs if n not in projectors]
    notes = [f"the repo has a vision projector ({', '.join(projectors)}); llmd serves text only, so it is not "
             "downloaded"] if projectors else []
    if not models:
        raise ModelNotFound(f"{ref.repo} has no GGUF model files (files: {', '.join(sorted(files)) or 'none'}); "
                            "llmd runs GGUF models: look for a -GGUF repo of this model", "model")
    if ref.filename:
        wanted = next((n for n in models if n == ref.filename or Path(n).name == ref.filename), None)
        if wanted is None:
            raise ModelNotFound(f"{ref.repo} has no file {ref.filename!r}; its GGUF files: {', '.join(models)}",
                                "model")
        quant = quant_of(wanted) or Path(wanted).stem
        chosen = _parts_of(wanted, models)
    elif ref.quant and (tagged := [n for n in models if _names_tag(n, ref.quant)]):
        quant = ref.quant  # a tag as the repo's files spell it (UD-Q4_K_XL, IQ4_XS...)
        chosen = _parts_of(sorted(tagged)[0], models)
    else:
        by_quant: dict[str, list[str]] = {}
        for n in models:
            q = quant_of(n)
            if q is not None:
                by_quant.setdefault(q, []).append(n)
        if not by_quant:
            raise ModelNotFound(f"{ref.repo}: no GGUF file names a quantization ({', '.join(models)}); pull one by "
                                "its file name: USER/REPO/FILE.gguf", "model")
        asked = ref.quant or DEFAULT_QUANT
        quant = asked if asked in by_quant else _closest(asked, list(by_quant))
        if quant != asked:
            notes.append(f"{ref.repo} has no {asked} file; pulling the closest it has, {quant} "
                         f"(it has: {', '.join(sorted(by_quant, key=_rank))})")
        first = sorted(by_quant[quant])[0]
        chosen = _parts_of(first, models)
    return PullPlan(ref, info.sha or "main", quant, [files[n] for n in chosen], model_name(ref, quant), notes)


def _names_tag(filename: str, tag: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9])", Path(filename).name, re.IGNORECASE) is not None


def _rank(q: str) -> int:
    return QUANT_ORDER.index(q) if q in QUANT_ORDER else len(QUANT_ORDER)


def _closest(asked: str, have: list[str]) -> str:
    """The nearest in QUANT_ORDER; on a tie, the one with more bits."""
    return min(have, key=lambda q: (abs(_rank(q) - _rank(asked)), _rank(q)))


def _parts_of(first: str, models: list[str]) -> list[str]:
    """Every part of a split GGUF, in order (one name for a whole file); refused if one is missing."""
    m = _SPLIT_RE.search(first)
    if m is None:
        return [first]
    stem, count = first[: m.start()], int(m.group(2))
    parts = [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [p for p in parts if p not in models]
    if missing:
        raise ModelNotFound(f"the split model {stem} lists {count} parts but the repo lacks {', '.join(missing)}",
                            "model")
    return parts


Progress = Callable[[HubFile, int], None]  # (file, bytes of it on disk so far)


def download(p: PullPlan, dest: Path, progress: Progress | None = None) -> Path:
    """Fetch every file of `p` into `dest` (resuming partial ones), each checked against the Hub's
    sha256; returns the path llama.cpp loads (the first part). A failed check deletes the file."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in p.files:
        inside(dest, f.name)
    need = sum(max(0, f.size - _have(dest / f.name)) for f in p.files if not (dest / f.name).exists())
    free = shutil.disk_usage(dest).free
    if need > free:
        raise InsufficientStorage(f"pulling {p.name} needs {need / 2**20:.0f} MiB more but {dest} has "
                                  f"{free / 2**20:.0f} MiB free; free some space or set LLMD_HOME to a larger disk")
    for f in p.files:
        _fetch(p, f, dest, progress)
    return dest / p.files[0].name


def inside(folder: Path, name: str) -> Path:
    """folder/name, refused unless it stays inside `folder`: file names come from the Hub's listing."""
    target = (folder / name).resolve()
    if not target.is_relative_to(folder.resolve()) or target == folder.resolve():
        raise UpstreamError(f"the Hub lists a file named {name!r}, which would be written outside {folder}; "
                            "nothing was downloaded")
    return target


def _have(path: Path) -> int:
    part = path.with_name(path.name + PART)
    return part.stat().st_size if part.exists() else 0


def _fetch(p: PullPlan, f: HubFile, dest: Path, progress: Progress | None) -> None:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    target = inside(dest, f.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and target.stat().st_size == f.size:
        if progress:
            progress(f, f.size)
        return
    part = target.with_name(target.name + PART)
    url = hf_hub_url(p.ref.repo, f.name, revision=p.revision)
    headers = build_hf_headers()
    try:
        meta = get_hf_file_metadata(url, headers=headers)
        expected = f.sha256 or (meta.etag if meta.etag and re.fullmatch(r"[0-9a-f]{64}", meta.etag) else None)
        size = meta.size or f.size
        have = part.stat().st_size if part.exists() else 0
        if have > size:  # not a prefix of this file: start again
            part.unlink()
            have = 0
        if have < size:
            with part.open("ab") as out:
                http_get(meta.location, out, resume_size=have, headers=headers, expected_size=size,
                         displayed_filename=f.name, tqdm_class=_bar(f, progress))
    except Exception as e:  # HTTP and network errors of any client huggingface_hub uses, disk errors
        raise UpstreamError(f"downloading {f.name} from {p.ref.repo} failed ({type(e).__name__}: {e}); run the "
                            f"pull again to resume ({_have(target)} of {f.size} bytes are kept)") from e
    if expected is not None:
        got = file_digest(part).removeprefix("sha256:")
        if got != expected:
            part.unlink()
            raise UpstreamError(f"{f.name} from {p.ref.repo} does not match the sha256 the Hub lists (expected "
                                f"{expected}, got {got}); the download was deleted and nothing was registered: "
                                "pull again")
    os.replace(part, target)


def _bar(f: HubFile, progress: Progress | None) -> type:
    """The progress object huggingface_hub drives (tqdm's shape: made with total/initial, updated
    by chunk sizes), forwarding bytes-on-disk to `progress`."""

    class Bar:
        def __init__(self, *args: Any, initial: int = 0, **kwargs: Any) -> None:
            self.n = initial
            if progress:
                progress(f, self.n)

        def __enter__(self) -> Bar:
            return self

        def __exit__(self, *exc: Any) -> None:
            return None

        def update(self, n: int = 1) -> None:
            self.n += n
            if progress:
                progress(f, self.n)

        def close(self) -> None:
            return None

    return Bar


def files_of(path: Path) -> list[Path]:
    """The files a pulled model consists of: the path, or every part of a split model."""
    m = _SPLIT_RE.search(path.name)
    if m is None:
        return [path]
    stem, count = path.name[: m.start()], int(m.group(2))
    return [path.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def pull(ref_text: str, registry: Any, models_dir: Path, progress: Progress | None = None,
         name: str | None = None, on_plan: Callable[[PullPlan], None] | None = None) -> dict[str, Any]:
    """Plan, download and register `ref_text`; the registry row (with `notes`). A model already
    pulled from the same reference is returned as it is. Nothing is registered unless every file
    arrived whole and checked; an interruption leaves the partial files to resume from."""
    ref = parse_ref(ref_text)
    p = plan(ref)
    if name:
        p.name = name
    if on_plan:
        on_plan(p)
    if registry.has(p.name):
        row = registry.get(p.name)
        if row.get("origin") == ref.origin and Path(row["path"]).exists():
            return {**row, "notes": [*p.notes, f"{p.name} was already pulled"]}
        raise BadRequest(f"a model named {p.name!r} is already registered (from {row['source']}); pull under "
                         "another name with --name", "name")
    dest = models_dir / "hf" / ref.repo.replace("/", "--")
    path = download(p, dest, progress)
    sha = p.files[0].sha256
    row = registry.add(path, p.name, source="pulled", origin=ref.origin, **({"digest": "sha256:" + sha} if sha else {}))
    return {**row, "notes": p.notes}
