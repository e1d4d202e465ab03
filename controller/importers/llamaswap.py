"""llama-swap's ``config.yaml`` -> a slotctl stack.

Written from llama-swap's documented configuration (v250-5-g0bdb3720:
``config.example.yaml``, ``config-schema.json``, ``docs/configuration.md``): every key
the schema documents is either mapped or reported (:mod:`controller.importers.report`),
and a key it does not document is reported too. Each model becomes a ``[[model]]`` and a
``[[slot]]`` (:mod:`controller.importers.servers` reads its ``cmd``); its ``aliases`` and
the ``selectors`` become ``[[alias]]``; groups become exclusive groups and pins;
``hooks.on_startup.preload`` becomes ``autoload``; ``apiKeys`` become the ``slotctl key
create`` commands to run. See docs/migrating-from-llama-swap.md for the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import urlsplit

import yaml

from controller.importers.argv import split_command
from controller.importers.hub import Lister
from controller.importers.macros import expand_config
from controller.importers.report import ImportReport
from controller.importers.servers import PORT_TOKEN, import_server
from controller.importers.stackdoc import (
    ImportResult,
    StackDoc,
    model_id_of,
    slot_name_of,
    stack_name_of,
)
from controller.model.errors import ImportSourceError

__all__ = ["DOCUMENTED_MODEL_KEYS", "DOCUMENTED_TOP_KEYS", "import_llama_swap"]

_LOGS = (
    "slotctl's own logging is `slotctl up --log-level/--log-format`; a server's output is "
    "`slotctl slot logs NAME`"
)
_METRICS = "slotctl's metrics are /metrics (Prometheus) and its event stream (/api/events)"
# Top-level keys (config-schema.json, v250) that carry nothing slotctl can use: why.
_DROPPED_TOP: Final[dict[str, str]] = {
    "logLevel": _LOGS,
    "logTimeFormat": _LOGS,
    "logToStdout": _LOGS,
    "metricsMaxInMemory": _METRICS,
    "captureBuffer": "slotctl does not capture request and response bodies",
    "store": _METRICS,
    "ui": "slotctl's dashboard has no session-id columns",
    "performance": _METRICS,
    "sendLoadingState": "slotctl does not inject loading messages into responses",
    "unloadTimeout": "the grace before a server is killed is the runtime's (SIGTERM, then "
    "SIGKILL), not a slot setting",
    "upstream": "slotctl has no /upstream passthrough",
    "profiles": "slotctl has no runtime-switched model id rewrites: declare [[alias]] "
    "entries and edit them",
    "peers": "slotctl serves its own slots; a remote server is not a slot",
    "matrix": "slotctl admits loads by memory, not by declared combinations: each model's "
    "footprint is estimated from its file (slotctl model footprint ID; memory_gb overrides "
    "it), so the ones that fit together do",
}
DOCUMENTED_TOP_KEYS: Final = frozenset(
    {
        *_DROPPED_TOP,
        "healthCheckTimeout",
        "startPort",
        "includeAliasesInList",
        "globalTTL",
        "macros",
        "apiKeys",
        "selectors",
        "models",
        "groups",
        "hooks",
        "routing",
    }
)
_DROPPED_MODEL: Final[dict[str, str]] = {
    "name": "slotctl's /v1/models lists a model by its id (no display name)",
    "description": "slotctl's /v1/models lists a model by its id (no description)",
    "unloadTimeout": _DROPPED_TOP["unloadTimeout"],
    "filters": "slotctl's router does not rewrite request bodies (a model's sampling keys "
    "are defaults it keeps, not parameters it sets)",
    "metadata": "slotctl's /v1/models carries no per-model metadata",
    "sendLoadingState": _DROPPED_TOP["sendLoadingState"],
    "unlisted": "slotctl's /v1/models lists every catalogue model",
    "compat": "slotctl's router does not route websockets",
    "capabilities": "slotctl's /v1/models does not carry capabilities (a slot's `type` "
    "says which endpoints it serves)",
}
_OWNED_MODEL: Final[dict[str, str]] = {
    "cmdStop": "slotctl stops its servers itself (SIGTERM, then SIGKILL; a container "
    "through the docker runtime)",
    "checkEndpoint": "slotctl probes readiness with /v1/models and one sentinel request, "
    "and liveness with the provider's own endpoint",
}
DOCUMENTED_MODEL_KEYS: Final = frozenset(
    {
        *_DROPPED_MODEL,
        *_OWNED_MODEL,
        "macros",
        "cmd",
        "env",
        "proxy",
        "aliases",
        "ttl",
        "useModelName",
        "concurrencyLimit",
        "timeouts",
    }
)
_PREFER: Final = {"warm": "warm", "pin": "first", "spillover": "spread"}
_DEFAULT_GROUP: Final = "(default)"


def _load(text: str, source: str) -> Mapping[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ImportSourceError(f"{source}: not YAML: {exc}", source=source) from None
    if not isinstance(data, Mapping) or not isinstance(data.get("models"), Mapping):
        raise ImportSourceError(
            f"{source}: a llama-swap config is a mapping with `models` (a mapping of model ids)",
            source=source,
        )
    return data


def _number(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ImportSourceError(f"{key}: a number is expected, not {value!r}", key=key)
    return float(value)


class _Importer:
    def __init__(self, data: Mapping[str, Any], stack: str, lister: Lister | None) -> None:
        self.data = data
        self.report = ImportReport("llama-swap")
        self.doc = StackDoc(stack_name_of(stack))
        self.lister = lister
        self.ids: dict[str, str] = {}  # llama-swap id -> catalogue id
        self.commands: list[str] = []

    # -------------------------------------------------------------- top level

    def run(self) -> ImportResult:
        data = self.data
        for key in data:
            if key not in DOCUMENTED_TOP_KEYS:
                self.report.add(str(key), "dropped", "not a documented llama-swap key (v250)")
            elif key in _DROPPED_TOP and key != "matrix":
                self.report.add(str(key), "dropped", _DROPPED_TOP[key])
        if "startPort" in data:
            self.report.add(
                "startPort", "owned", 'slotctl chooses each slot\'s port (port = "auto")'
            )
        if data.get("includeAliasesInList"):
            self.report.add(
                "includeAliasesInList",
                "approximated",
                "slotctl lists an alias in /v1/models (with alias: true) once a member is served",
            )
        preload = self._preload()
        models: Mapping[str, Any] = data["models"]
        alias_ids = self._alias_ids(models)
        for raw_id, body in models.items():
            self._model(str(raw_id), body, preload, alias_ids)
        self._groups()
        for raw_id, body in models.items():
            if isinstance(body, Mapping):
                self._aliases(str(raw_id), body.get("aliases"))
        self._selectors(data.get("selectors"))
        self._api_keys(data.get("apiKeys"))
        return ImportResult(self.doc, self.report, self.commands)

    def _preload(self) -> list[str]:
        hooks = self.data.get("hooks")
        if hooks is None:
            return []
        if not isinstance(hooks, Mapping):
            raise ImportSourceError("hooks: a mapping is expected", key="hooks")
        for name, value in hooks.items():
            if name != "on_startup":
                self.report.add(f"hooks.{name}", "dropped", "llama-swap documents on_startup only")
            elif isinstance(value, Mapping):
                for action in value:
                    if action != "preload":
                        self.report.add(
                            f"hooks.on_startup.{action}",
                            "dropped",
                            "llama-swap documents preload only",
                        )
        startup = hooks.get("on_startup") or {}
        preload = startup.get("preload") or [] if isinstance(startup, Mapping) else []
        return [str(m) for m in preload]

    def _alias_ids(self, models: Mapping[str, Any]) -> set[str]:
        out: set[str] = set()
        for body in models.values():
            for alias in (body.get("aliases") or []) if isinstance(body, Mapping) else []:
                out.add(str(alias.get("id") if isinstance(alias, Mapping) else alias).lower())
        selectors = self.data.get("selectors")
        if isinstance(selectors, Mapping):
            out |= {str(s).lower() for s in selectors}
        return out

    # -------------------------------------------------------------- models

    def _model(self, raw_id: str, body: object, preload: list[str], alias_ids: set[str]) -> None:
        key = f"models.{raw_id}"
        if not isinstance(body, Mapping) or not isinstance(body.get("cmd"), str):
            raise ImportSourceError(f"{key}: a model needs `cmd` (a string)", key=key)
        for field in body:
            if field not in DOCUMENTED_MODEL_KEYS:
                self.report.add(
                    f"{key}.{field}", "dropped", "not a documented llama-swap model key (v250)"
                )
            elif field in _DROPPED_MODEL:
                self.report.add(f"{key}.{field}", "dropped", _DROPPED_MODEL[field])
            elif field in _OWNED_MODEL:
                self.report.add(f"{key}.{field}", "owned", _OWNED_MODEL[field])
        model_id = model_id_of(raw_id, key, self.report)
        self.ids[raw_id] = model_id
        env = self._env(body.get("env"), key)
        argv = split_command(body["cmd"], key=f"{key}.cmd")
        srv = import_server(argv, env=env, key=key, report=self.report, lister=self.lister)
        model: dict[str, Any] = {"id": model_id, **srv.model}
        taken = {s["name"] for s in self.doc.slots} | alias_ids
        slot: dict[str, Any] = {
            "name": slot_name_of(model_id, taken),
            "provider": srv.provider,
            "model": {"default": model_id},
        }
        slot.update(srv.slot)
        self._proxy(body.get("proxy"), slot, key)
        slot["autoload"] = raw_id in preload
        ttl = self._ttl(body.get("ttl"), key)
        if ttl > 0:
            slot["ttl_s"] = ttl
            if slot["autoload"]:
                self.report.add(
                    f"{key}.ttl",
                    "approximated",
                    "preloaded (autoload): slotctl keeps an autoload slot loaded, so its ttl "
                    "does not unload it",
                )
        health = self.data.get("healthCheckTimeout")
        if health is not None:
            slot["warmup_timeout_s"] = max(15.0, _number(health, "healthCheckTimeout"))
        self._limits(body, slot, key)
        upstream = body.get("useModelName")
        if upstream and srv.provider != "openai-compatible":
            self.report.add(
                f"{key}.useModelName",
                "owned",
                "slotctl's providers serve the model under its id, so no rewrite is needed",
            )
        elif upstream:
            self._upstream_name(raw_id, str(upstream), model, slot, key)
        if srv.server:
            slot["server"] = srv.server
        self.doc.models.append(model)
        self.doc.slots.append(slot)

    def _upstream_name(
        self, raw_id: str, upstream: str, model: dict[str, Any], slot: dict[str, Any], key: str
    ) -> None:
        """``useModelName`` of a server slotctl cannot name: the catalogue model takes the
        upstream name and the llama-swap id becomes an ``[[alias]]`` of it, whose rewrite
        of the request's ``model`` is llama-swap's."""
        upstream_id = model_id_of(upstream, f"{key}.useModelName", self.report)
        taken = {m["id"] for m in self.doc.models} | set(self.ids) - {raw_id}
        if upstream_id in taken:
            self.report.add(
                f"{key}.useModelName",
                "approximated",
                f"{upstream_id!r} is another model's id: requests reach the server as "
                f"{model['id']!r}",
            )
            return
        alias_id = model["id"]
        model["id"] = upstream_id
        slot["model"] = {"default": upstream_id}
        if slot["name"] == alias_id:  # an alias may not be a slot's name
            names = {s["name"] for s in self.doc.slots} | {alias_id}
            slot["name"] = slot_name_of(upstream_id, names)
        self.ids[raw_id] = upstream_id
        self.doc.aliases.append({"id": alias_id, "models": [upstream_id], "prefer": "first"})
        self.report.add(
            f"{key}.useModelName",
            "owned",
            f"the catalogue model is {upstream_id!r} and {alias_id!r} an alias of it: the "
            "router rewrites the request's model as llama-swap does",
        )

    def _env(self, value: object, key: str) -> dict[str, str]:
        if value is None:
            return {}
        if not isinstance(value, list):
            raise ImportSourceError(f"{key}.env: a list of NAME=value strings", key=f"{key}.env")
        out: dict[str, str] = {}
        for item in value:
            name, eq, val = str(item).partition("=")
            if not eq or not name:
                raise ImportSourceError(f"{key}.env: {item!r} is not NAME=value", key=key)
            out[name] = val
        return out

    def _proxy(self, proxy: object, slot: dict[str, Any], key: str) -> None:
        if not isinstance(proxy, str) or not proxy:
            return
        parts = urlsplit(proxy.replace(PORT_TOKEN, "1"))
        if parts.hostname not in ("localhost", "127.0.0.1", "::1", None):
            self.report.add(
                f"{key}.proxy",
                "dropped",
                f"{proxy}: slotctl routes to servers it runs on this host, not to {parts.hostname}",
            )
            return
        if PORT_TOKEN not in proxy and parts.port and "port" not in slot:
            slot["port"] = parts.port
        if parts.path.strip("/"):
            self.report.add(
                f"{key}.proxy",
                "dropped",
                f"the path {parts.path!r}: slotctl routes /v1 requests to the server's root",
            )
        self.report.add(
            f"{key}.proxy",
            "owned",
            "slotctl routes to the slot's port" + (f" ({slot['port']})" if "port" in slot else ""),
        )

    def _ttl(self, value: object, key: str) -> float:
        global_ttl = self.data.get("globalTTL")
        ttl = -1.0 if value is None else _number(value, f"{key}.ttl")
        if ttl < 0:
            ttl = 0.0 if global_ttl is None else _number(global_ttl, "globalTTL")
        return ttl

    def _limits(self, body: Mapping[str, Any], slot: dict[str, Any], key: str) -> None:
        limit = body.get("concurrencyLimit")
        if limit:
            slot["max_concurrency"] = int(_number(limit, f"{key}.concurrencyLimit"))
            self.report.add(
                f"{key}.concurrencyLimit",
                "approximated",
                "max_concurrency: beyond it requests wait their turn (up to max_queue, then "
                "429) instead of an immediate 429",
            )
        timeouts = body.get("timeouts")
        if not isinstance(timeouts, Mapping):
            return
        for name, value in timeouts.items():
            tkey = f"{key}.timeouts.{name}"
            if name == "responseHeader" and value:
                slot["upstream_idle_s"] = _number(value, tkey)
                self.report.add(
                    tkey,
                    "approximated",
                    "upstream_idle_s: slotctl bounds the time without a byte from the "
                    "server, the answer's head included",
                )
            elif name == "connect":
                self.report.add(tkey, "owned", "slotctl bounds a connect by 10 s")
            else:
                self.report.add(
                    tkey, "dropped", "slotctl keeps its own connection pools and timeouts"
                )

    # -------------------------------------------------------------- groups

    def _groups(self) -> None:
        legacy_groups = self.data.get("groups")
        routing = self.data.get("routing")
        groups: Mapping[str, Any] | None = (
            legacy_groups if isinstance(legacy_groups, Mapping) else None
        )
        matrix_key: str | None = "matrix" if "matrix" in self.data else None
        if isinstance(routing, Mapping):
            groups, matrix_key = self._routing(routing, groups, matrix_key)
        if matrix_key is not None:
            self.report.add(matrix_key, "dropped", _DROPPED_TOP["matrix"])
            return
        members: dict[str, dict[str, Any]] = {}
        for name, group in (groups or {}).items():
            if not isinstance(group, Mapping):
                raise ImportSourceError(f"groups.{name}: a mapping", key=f"groups.{name}")
            members[str(name)] = {
                "swap": group.get("swap", True),
                "exclusive": group.get("exclusive", True),
                "persistent": group.get("persistent", False),
                "members": [str(m) for m in group.get("members") or []],
            }
            for field in group:
                if field not in ("swap", "exclusive", "persistent", "members"):
                    self.report.add(
                        f"groups.{name}.{field}", "dropped", "not a documented group key"
                    )
        grouped = {m for g in members.values() for m in g["members"]}
        ungrouped = [i for i in self.ids if i not in grouped]
        if ungrouped:  # llama-swap's implicit group: one at a time, unloading the others
            members[_DEFAULT_GROUP] = {
                "swap": True,
                "exclusive": True,
                "persistent": False,
                "members": ungrouped,
            }
        swapping = [g for g in members.values() if not g["persistent"]]
        one_at_a_time = all(g["swap"] and g["exclusive"] for g in swapping)
        for name, group in members.items():
            label = "default" if name == _DEFAULT_GROUP else name
            where = f"groups.{name}"
            for member in group["members"]:
                if member not in self.ids:
                    self.report.add(
                        f"{where}.members", "needs-input", f"{member!r} is no model of models"
                    )
            known = [self.ids[m] for m in group["members"] if m in self.ids]
            if group["persistent"]:
                for model_id in known:
                    slot = self.doc.slot_of(model_id)
                    if slot is not None:
                        slot["pinned"] = True
            if not group["persistent"] and one_at_a_time and len(swapping) > 1:
                label = "llama-swap"  # every swapping group unloads the others: one in all
            elif not group["swap"] or len(known) < 2:
                label = ""
            if label:
                for model_id in known:
                    model = self.doc.model(model_id)
                    if model is not None:
                        model["exclusive_group"] = label[:63]
            others = [g for n, g in members.items() if n != name and not g["persistent"]]
            if group["exclusive"] and others and not (one_at_a_time and not group["persistent"]):
                self.report.add(
                    f"{where}.exclusive",
                    "approximated",
                    "slotctl unloads other slots only to make room for a load (by memory), "
                    "not because a member of this group loads",
                )

    def _routing(
        self,
        routing: Mapping[str, Any],
        groups: Mapping[str, Any] | None,
        matrix_key: str | None,
    ) -> tuple[Mapping[str, Any] | None, str | None]:
        router = routing.get("router")
        if isinstance(router, Mapping):
            settings = router.get("settings") or {}
            use = router.get("use", "group")
            if use == "matrix":
                return None, "routing.router.settings.matrix"
            if isinstance(settings, Mapping):
                if "matrix" in settings:
                    self.report.add(
                        "routing.router.settings.matrix",
                        "dropped",
                        "not in use (routing.router.use is group)",
                    )
                if isinstance(settings.get("groups"), Mapping):
                    groups = settings["groups"]
        scheduler = routing.get("scheduler")
        if isinstance(scheduler, Mapping):
            self.report.add(
                "routing.scheduler.use",
                "owned",
                "slotctl's wait queue is first come, first served by key priority classes",
            )
            fifo = (scheduler.get("settings") or {}).get("fifo") or {}
            if isinstance(fifo, Mapping) and fifo.get("priority"):
                self.report.add(
                    "routing.scheduler.settings.fifo.priority",
                    "dropped",
                    "slotctl orders waiting requests by their keys' priority classes "
                    "(`slotctl key create --priority`), not by model; a slot's priority is "
                    "its eviction order",
                )
        for name in routing:
            if name not in ("router", "scheduler"):
                self.report.add(f"routing.{name}", "dropped", "not a documented routing key")
        return groups, matrix_key

    # -------------------------------------------------------------- aliases and keys

    def _target(self, name: str) -> str | None:
        if name in self.ids:
            return self.ids[name]
        for alias in self.doc.aliases:
            if alias["id"] == name:
                return str(alias["models"][0])
        return None

    def _aliases(self, raw_id: str, aliases: object) -> None:
        if not aliases:
            return
        if not isinstance(aliases, list):
            raise ImportSourceError(f"models.{raw_id}.aliases: a list", key=raw_id)
        for i, alias in enumerate(aliases):
            if isinstance(alias, Mapping):  # an older form: {id, name, unlisted}
                extra = sorted(k for k in alias if k != "id")
                if extra:
                    self.report.add(
                        f"models.{raw_id}.aliases[{i}]",
                        "dropped",
                        f"{', '.join(extra)}: an alias is listed by its id",
                    )
                alias = alias.get("id")
            alias_id = model_id_of(str(alias), f"models.{raw_id}.aliases[{i}]", self.report)
            self.doc.aliases.append(
                {"id": alias_id, "models": [self.ids[raw_id]], "prefer": "first"}
            )

    def _selectors(self, selectors: object) -> None:
        if not isinstance(selectors, Mapping):
            return
        for sid, sel in selectors.items():
            key = f"selectors.{sid}"
            if not isinstance(sel, Mapping):
                raise ImportSourceError(f"{key}: a mapping", key=key)
            strategy = str(sel.get("strategy", "warm"))
            targets: list[str] = []
            for target in sel.get("targets") or []:
                model_id = self._target(str(target))
                if model_id is None:
                    self.report.add(
                        f"{key}.targets",
                        "dropped",
                        f"{target!r} is no local model or alias (a peer's): slotctl routes to "
                        "its own slots",
                    )
                elif model_id not in targets:
                    targets.append(model_id)
            for field in sel:
                if field in ("name", "description", "metadata", "unlisted"):
                    self.report.add(
                        f"{key}.{field}",
                        "dropped",
                        _DROPPED_MODEL.get(field, "an alias is listed by its id with its members"),
                    )
                elif field not in ("strategy", "targets", "settings"):
                    self.report.add(f"{key}.{field}", "dropped", "not a documented selector key")
            if strategy == "spillover" or sel.get("settings"):
                self.report.add(
                    f"{key}.strategy",
                    "approximated",
                    "prefer = spread: the least busy resident member, not a fill to a "
                    "reservation count",
                )
            if strategy not in _PREFER:
                self.report.add(f"{key}.strategy", "needs-input", f"unknown strategy {strategy!r}")
            if not targets:
                continue
            alias_id = model_id_of(str(sid), key, self.report)
            self.doc.aliases.append(
                {"id": alias_id, "models": targets, "prefer": _PREFER.get(strategy, "warm")}
            )

    def _api_keys(self, keys: object) -> None:
        if not keys:
            return
        if not isinstance(keys, list):
            raise ImportSourceError("apiKeys: a list of strings", key="apiKeys")
        for i, _ in enumerate(keys):
            self.commands.append(f"slotctl key create llama-swap-{i + 1} --scope inference")
        self.report.add(
            "apiKeys",
            "approximated",
            f"{len(keys)} key(s): slotctl generates its keys (the secrets are not carried "
            "over, nor printed): run the `slotctl key create` commands printed and give "
            "the clients their new keys",
        )


def import_llama_swap(
    text: str,
    *,
    source: str = "config.yaml",
    stack: str = "llama-swap",
    env: Mapping[str, str] | None = None,
    lister: Lister | None = None,
) -> ImportResult:
    """A llama-swap ``config.yaml``'s text as a stack, with its report.

    ``env`` answers ``${env.VAR}`` (the caller's environment); ``lister`` lists a hub
    repository's files to resolve ``-hf user/model:quant`` (None: offline).
    """
    raw = _load(text, source)
    report = ImportReport("llama-swap")
    data = expand_config(raw, env or {}, report)
    importer = _Importer(data, stack, lister)
    importer.report.findings[:0] = report.findings
    return importer.run()
