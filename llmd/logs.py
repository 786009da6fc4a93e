"""Structured logs: one JSON object per line in the log dir, rotated; and readable lines on stderr.

Request lines carry the request id, model, API, outcome and timings; prompts and replies are
never logged."""

from __future__ import annotations

import json
import logging
import logging.handlers
import time
from pathlib import Path

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(log_file: Path, level: int = logging.INFO, max_bytes: int = 10 * 1024 * 1024, backups: int = 5) -> None:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.setLevel(level)
    to_file = logging.handlers.RotatingFileHandler(log_file, maxBytes=max_bytes, backupCount=backups)
    to_file.setFormatter(JsonFormatter())
    to_err = logging.StreamHandler()
    to_err.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root.handlers[:] = [to_file, to_err]
    # httpx logs every request it makes at INFO (the remote relay's, one per request): not news
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(logging.WARNING)


def daemon_log_file() -> str | None:
    """The file this process logs to (the daemon's JSON log, after setup), for the workers it starts."""
    return next((h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)), None)


def worker_setup(log_file: str | None) -> None:
    """A model worker's logging: warnings on stderr (the daemon's), and INFO lines into the daemon's
    JSON log when it has one (an engine's line on a cancelled request says how far its prompt was
    read; a grown embedding context says why). The daemon's handler rotates the file; a
    WatchedFileHandler opens the new one when it does. One line is one write, so lines from the
    daemon and its workers do not interleave."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    to_err = logging.StreamHandler()
    to_err.setLevel(logging.WARNING)
    to_err.setFormatter(logging.Formatter("%(asctime)s worker %(levelname)s %(message)s"))
    handlers: list[logging.Handler] = [to_err]
    if log_file:
        try:
            to_file = logging.handlers.WatchedFileHandler(log_file)
        except OSError:  # the log dir went away: stderr alone, as before
            pass
        else:
            to_file.setFormatter(JsonFormatter())
            handlers.append(to_file)
    root.handlers[:] = handlers
