"""What a user types into a config, checked before the typed models (qerl.config) are built from it.

    from qerl.config_input import load_yaml_file
    data = load_yaml_file("config/config.yaml")   # what yaml.safe_load gives, or QerlError

The YAML file is read by PyYAML's safe loader with three refusals, each one line naming the file, the line and
column, and the key, before anything is built from the document:
- Aliases: anchors, aliases and `<<:` merges work, but the document's size with every alias expanded is bounded
  (MAX_EXPANDED_NODES, counted while composing, where an alias costs the nodes it stands for): a billion-laughs
  bomb stops at the alias that crosses the bound, before pydantic, Snakemake or json.dumps could walk its shared
  objects one by one. An alias inside its own anchor (a cycle) is refused too.
- Duplicate keys in one mapping (PyYAML keeps the last silently): the key, its line and the line of the first.
  A key that overrides one brought in by `<<:` is not a duplicate.
- Syntax errors: the line and column PyYAML points at.
The Snakefile reads every config file through this before Snakemake's own loader sees it.

The strings that become paths, refs or stop conditions get their rules here as annotated types (ModelRef,
Revision, ResultsDir, MethodName, StopString): the error names the key and the value.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, Field

from qerl.errors import QerlError
from qerl.hub import revision_problem
from qerl.paths import results_dir_problem

# config/config.yaml expands to ~4,000 nodes; a bound 25x that parses in well under a second
MAX_EXPANDED_NODES = 100_000
MAX_BYTES = 10_000_000  # a config is kilobytes
_MERGE = "tag:yaml.org,2002:merge"


class _Refused(Exception):
    def __init__(self, mark, problem: str):
        super().__init__(problem)
        self.mark, self.problem = mark, problem


class _Loader(yaml.SafeLoader):
    """SafeLoader that counts expanded nodes and refuses duplicate keys, both while composing (nothing built yet)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.expanded = 0  # nodes composed so far, each alias counted as the nodes it stands for
        self.sizes: dict[int, int] = {}  # id(node) -> its nodes, aliases expanded (set once it is complete)
        self.keys: list[str] = []  # dotted path of the node being composed

    def where(self, key: str | None = None) -> str:
        return ".".join(self.keys + ([key] if key is not None else [])) or "<root>"

    def compose_node(self, parent, index):
        label = index.value if isinstance(index, yaml.Node) else index  # a mapping's key node, a sequence's index
        if label is not None:
            self.keys.append(str(label))
        try:
            if self.check_event(yaml.AliasEvent):
                self._count_alias(self.peek_event())
                return super().compose_node(parent, index)
            before = self.expanded
            node = super().compose_node(parent, index)
            self.expanded += 1
            self.sizes[id(node)] = self.expanded - before
            return node
        finally:
            if label is not None:
                self.keys.pop()

    def _count_alias(self, event) -> None:
        node = self.anchors.get(event.anchor)
        if node is None:
            return  # an undefined alias: PyYAML's own error follows
        size = self.sizes.get(id(node))
        if size is None:
            raise _Refused(event.start_mark, f"{self.where()}: alias *{event.anchor} inside its own anchor (a cycle)")
        self.expanded += size
        if self.expanded > MAX_EXPANDED_NODES:
            raise _Refused(event.start_mark, f"{self.where()}: alias *{event.anchor} expands the document past "
                           f"{MAX_EXPANDED_NODES:,} nodes (nested aliases, a YAML alias bomb?); refused unexpanded")

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        first: dict[tuple[str, str], yaml.Node] = {}
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE:
                seen = first.setdefault((key.tag, key.value), key)
                if seen is not key:
                    raise _Refused(key.start_mark, f"{self.where(key.value)}: duplicate key {key.value!r} (first "
                                   f"at line {seen.start_mark.line + 1}); YAML would silently keep the last")
        return node


def _at(mark) -> str:
    return f"{mark.line + 1}:{mark.column + 1}" if mark is not None else "?"


def load_yaml_file(path: str | Path) -> Any:
    """The data of one YAML document; a bad file is one QerlError line: `<file>:<line>:<column>: <key>: <problem>`."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_BYTES:
            raise QerlError(f"{path}: {path.stat().st_size:,} bytes, over the {MAX_BYTES:,} a config may have")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise QerlError(f"{path}: cannot be read ({type(err).__name__}: {err})") from None
    loader = _Loader(text)
    try:
        return loader.get_single_data()
    except _Refused as err:
        raise QerlError(f"{path}:{_at(err.mark)}: {err.problem}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        context = f" ({err.context})" if err.context else ""
        raise QerlError(f"{path}:{_at(mark)}: not valid YAML: {err.problem}{context}") from None
    except yaml.YAMLError as err:
        raise QerlError(f"{path}: not valid YAML ({(str(err).splitlines() or ['?'])[0]})") from None
    finally:
        loader.dispose()


def check_yaml_files(files: list[str | Path]) -> None:
    """Read each existing file as load_yaml_file does (the Snakefile, before Snakemake's own loader reads them)."""
    for file in files:
        if Path(file).exists():
            load_yaml_file(file)


# ------------------------------------------------------------------------------------------ string rules
# Experiment names become paths and shell words: no separators, no leading dot or dash, no spaces or quotes.
EXPERIMENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
_REPO_ID = re.compile(r"^[\w][\w.-]{0,95}(/[\w][\w.-]{0,95})?$")  # the hub's rule, less its '--'/'..' checks


def checked(problem) -> AfterValidator:
    """A pydantic check of a string by a `problem(value) -> why or None` rule; the error names the value."""
    def check(value: str) -> str:
        if why := problem(value):
            raise ValueError(f"{value!r} {why}")
        return value
    return AfterValidator(check)


def _model_problem(model: str) -> str | None:
    if model.startswith(("/", ".", "~")) or Path(model).exists() or _REPO_ID.match(model):
        return None
    return "is neither a local path nor a hub name like 'Qwen/Qwen2.5-7B-Instruct'"


ModelRef = Annotated[str, checked(_model_problem)]
Revision = Annotated[str, checked(revision_problem)]  # git's ref-name rules: no '..', '/x', '\\', NUL, ...
ResultsDir = Annotated[str, checked(results_dir_problem)]  # not /, a system folder or above the working directory
# an ablation's method name is part of each run's experiment name, so of its results folder
MethodName = Annotated[str, checked(lambda m: None if EXPERIMENT_NAME.match(m) else
                                    f"must match {EXPERIMENT_NAME.pattern} (it names results folders)")]
# an empty stop string matches at once: every completion would end before its first token
StopString = Annotated[str, checked(lambda s: None if s else "is an empty stop string (it ends every completion "
                                    "at once)"), Field(json_schema_extra={"minLength": 1})]
