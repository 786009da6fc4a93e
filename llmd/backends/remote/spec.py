"""A remote model's registry entry (where it runs, how to reach it; never the key itself), and
building one for `llmd models add --remote`: URLs checked, the upstream asked what it is and
which models it serves."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llmd.backends.remote.upstream import check_url, detect_kind, read_key
from llmd.errors import BadRequest


@dataclass(frozen=True)
class RemoteSpec:
    """A remote model's registry entry: where it runs and how to reach it (no secret in it)."""

    urls: tuple[str, ...]
    upstream_model: str
    kind: str = "openai-compatible"
    api_key_env: str | None = None
    api_key_file: str | None = None
    fallback: str | None = None
    insecure: bool = False

    @classmethod
    def from_json(cls, text: str) -> RemoteSpec:
        d = json.loads(text)
        return cls(tuple(d["urls"]), d["upstream_model"], d.get("kind", "openai-compatible"), d.get("api_key_env"),
                   d.get("api_key_file"), d.get("fallback"), bool(d.get("insecure")))

    def to_json(self) -> str:
        return json.dumps({"urls": list(self.urls), "upstream_model": self.upstream_model, "kind": self.kind,
                           "api_key_env": self.api_key_env, "api_key_file": self.api_key_file,
                           "fallback": self.fallback, "insecure": self.insecure})




def build(urls: list[str], upstream_model: str | None, api_key_env: str | None, api_key_file: str | None,
          fallback: str | None, insecure: bool, registry: Any) -> RemoteSpec:
    """Check the URLs and the key's source, and ask the first upstream that answers what it is and
    which model it serves (the only one, when `upstream_model` is not given)."""
    if not urls:
        raise BadRequest("give at least one upstream URL (--remote URL)", "remote")
    if api_key_env and api_key_file:
        raise BadRequest("give the API key by --api-key-env or --api-key-file, not both", "api_key_env")
    bases = [check_url(u, insecure) for u in urls]
    if len(set(bases)) != len(bases):
        raise BadRequest(f"an upstream URL is given twice ({', '.join(bases)})", "remote")
    if fallback is not None:
        row = registry.get(fallback)
        if row["format"] == "remote":
            raise BadRequest(f"the fallback {fallback} is itself remote; name a local model", "fallback")
        fallback = row["name"]
    key = read_key(api_key_env, api_key_file)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    errors = []
    for base in bases:
        try:
            kind, models = detect_kind(base, headers)
        except BadRequest as e:
            errors.append(e.message)
            continue
        if upstream_model is None:
            if len(models) != 1:
                raise BadRequest(f"{base} serves {len(models)} models ({', '.join(models[:10]) or 'none'}); name the "
                                 "one to use with --upstream-model", "upstream_model")
            upstream_model = models[0]
        elif models and upstream_model not in models and kind != "llama-server":  # it serves one, by any name
            raise BadRequest(f"{base} does not serve {upstream_model!r} (it serves {', '.join(models[:10])})",
                             "upstream_model")
        return RemoteSpec(tuple(bases), upstream_model, kind, api_key_env, api_key_file, fallback, insecure)
    raise BadRequest("no upstream answered, so llmd cannot tell what they serve: " + "; ".join(errors), "remote")
