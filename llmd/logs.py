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
