"""The files the agent reads while it runs, re-read when they change: its
config (which engines are shards) and its bearer token."""

from __future__ import annotations

import difflib
import logging
import re
import tomllib
from pathlib import Path

import wire
from sampler.off_thread import Said
from sampler.shards.pods import LABEL_KEY
from sampler.shards.pods import METRICS_URL as POD_METRICS_URL
from sampler.shards.selectors import Selector, ShardSpec

log = logging.getLogger(__name__)


def file_stamp(path: Path) -> tuple[int, int, int]:
    """A file's identity: stat follows the symlink, so a ConfigMap's or a
    Secret's update, which swaps `..data`, is a new inode."""
    st = path.stat()
    return st.st_ino, st.st_mtime_ns, st.st_size


class ConfigError(ValueError):
    pass


# The schema: what a key not here means is unknown, and a config that names
# one is refused (a `[[shards]]` for `[[shard]]` once started in silence,
# reporting no engine).
TOP_LEVEL = ("shard",)
SHARD_KEYS = ("id", "model", "replica", "select", "metrics_url", "model_label", "replica_label")


def _unknown(name: str, known: tuple[str, ...], what: str, line: int | None) -> ConfigError:
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f" (did you mean '{near[0]}'?)" if near else f" (known: {', '.join(known)})"
    at = f"line {line}: " if line is not None else ""
    return ConfigError(f"{at}unknown {what} '{name}'{hint}")


def _line_of(text: str, pattern: str, after: int = 0) -> int | None:
    """The 1-based line, at or after line `after`, where `pattern` first matches."""
    lines = text.splitlines()
    for number in range(after, len(lines)):
        if re.match(pattern, lines[number]):
            return number + 1
    return None


def _check_schema(doc: dict[str, object], text: str, source: str) -> None:
    for name in doc:
        if name not in TOP_LEVEL:
            line = _line_of(text, rf"\s*(\[\[?\s*)?[\"']?{re.escape(name)}[\"']?\s*[\].=]")
            raise ConfigError(f"{source}: {_unknown(name, TOP_LEVEL, 'table or key', line)}")
    shards = doc.get("shard")
    if not isinstance(shards, list):
        return
    header = 0
    for i, s in enumerate(shards):
        header = (_line_of(text, r"\s*\[\[\s*shard\s*\]\]", header) or 0)  # this shard's [[shard]], where it has one
        if not isinstance(s, dict):
            continue
        for key in s:
            if key not in SHARD_KEYS:
                line = _line_of(text, rf"\s*[\"']?{re.escape(key)}[\"']?\s*=", header)
                raise ConfigError(f"{source}: shard {i + 1}: {_unknown(key, SHARD_KEYS, 'key', line)}")


def parse_config(data: bytes, source: str = "config") -> list[ShardSpec]:
    """The agent's TOML: one [[shard]] table per engine (id, model, replica, select, metrics_url;
    a `k8s:` shard, one per matching pod: model_label, replica_label, and no id)."""
    try:
        text = data.decode()
        doc = tomllib.loads(text)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{source}: {e}") from None
    _check_schema(doc, text, source)
    shards = doc.get("shard", [])
    if not isinstance(shards, list) or len(shards) > wire.MAX_SHARDS:
        raise ConfigError(f"{source}: 'shard' must be a list of at most {wire.MAX_SHARDS} tables")
    specs = []
    for i, s in enumerate(shards):
        where = f"{source}: shard {i + 1}"
        if not isinstance(s, dict):
            raise ConfigError(f"{where}: must be a table")
        if not isinstance(s.get("select"), str):
            raise ConfigError(f"{where}: 'select' must be a selector string")
        try:
            selector = Selector.parse(s["select"])
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        pods = selector.kind == "k8s"
        if pods and "id" in s:
            raise ConfigError(f"{where}: a k8s: shard's id is each pod's NAMESPACE/POD[/CONTAINER]: drop 'id'")
        try:
            sid = f"k8s:{i}" if pods else wire.name(s.get("id"), "id")
            model = wire.name(s["model"], "model") if s.get("model") is not None else None
            replica = wire.name(s["replica"], "replica") if s.get("replica") is not None else None
        except wire.WireError as e:
            raise ConfigError(f"{where}: {e}") from None
        labels = {}
        for key in ("model_label", "replica_label"):
            value = s.get(key)
            if value is not None and (not pods or not isinstance(value, str) or not LABEL_KEY.fullmatch(value)):
                raise ConfigError(f"{where}: '{key}' must be a pod label's name, on a k8s: shard")
            labels[key] = value
        metrics_url = s.get("metrics_url")
        if metrics_url is not None and not (
            isinstance(metrics_url, str) and metrics_url.startswith(("http://", "https://"))
            and len(metrics_url) <= 2048 and metrics_url.isprintable() and " " not in metrics_url
        ):  # fmt: skip
            raise ConfigError(f"{where}: 'metrics_url' must be an http:// or https:// URL")
        if pods and metrics_url is not None and not POD_METRICS_URL.fullmatch(metrics_url):
            raise ConfigError(f"{where}: a k8s: shard's 'metrics_url' is http(s)://{{pod_ip}}:PORT/PATH, "
                              "PORT a number, {port:NAME} or {annotation:KEY}")  # fmt: skip
        if not pods and metrics_url is not None and "{pod_ip}" in metrics_url:
            raise ConfigError(f"{where}: '{{pod_ip}}' is a k8s: shard's alone")
        specs.append(ShardSpec(sid, selector, model, replica, metrics_url, **labels))
    ids = [w.id for w in specs]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{source}: shard ids must be unique")
    return specs


class ConfigFile:
    """The config file, re-read when it changes. A file that does not exist
    is "no engines configured yet" (the busiest groups are reported) and is
    watched until it appears: a ConfigMap mounted as optional. A change that
    does not parse is logged once and the previous shards stay in force."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self.specs: list[ShardSpec] | None = None
        try:
            self.specs = self._load()
        except FileNotFoundError:
            log.info("config %s does not exist (yet): reporting the busiest groups", path)

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            return file_stamp(self.path)
        except FileNotFoundError:
            return None

    def _load(self) -> list[ShardSpec]:
        self._seen = self._stamp()
        if self._seen is None:
            raise FileNotFoundError(self.path)
        return parse_config(self.path.read_bytes(), str(self.path))

    def changed(self) -> bool:
        """Whether `specs` changed: the file changed and parses, appeared, or went away."""
        try:
            stamp = self._stamp()
            if stamp == self._seen:
                return False
            if stamp is None:
                self._seen, self.specs = None, None
                log.warning("config %s went away: reporting the busiest groups", self.path)
                return True
            self.specs = self._load()
        except FileNotFoundError:
            return False  # gone between stat and read: the next look decides
        except (OSError, ConfigError) as e:
            kept = "the busiest groups" if self.specs is None else f"{len(self.specs)} shards"
            log.error("config not reloaded, keeping %s: %s", kept, e)
            return False
        log.info("config loaded: %d shards", len(self.specs))
        return True


class TokenFile:
    """The node's bearer token, re-read when the file changes: the kubelet
    rotates a projected service-account token well before it expires."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._token = ""
        self._said = Said()  # a problem said once, not once a heartbeat
        self.reload()

    def reload(self) -> None:
        stamp = file_stamp(self.path)
        if stamp == self._seen:
            return
        token = self.path.read_text().strip()
        if not token:
            raise ValueError(f"{self.path}: empty token file")
        if not token.isascii() or not token.isprintable():
            raise ValueError(f"{self.path}: the token must be printable ASCII")
        if self._seen is not None:
            log.info("token file %s changed: using the new token", self.path)
        self._seen, self._token = stamp, token

    def value(self) -> str:
        try:
            self.reload()
            self._said.changed("token", None)
        except (OSError, ValueError) as e:  # mid-rotation or removed: the last good token is still worth trying
            if self._said.changed("token", str(e)):
                log.warning("token file not re-read, keeping the last token: %s", e)
        return self._token
