"""A bounded, strict YAML reader for LMCache configs (every process that reads them; torch-free).

PyYAML's ``safe_load`` with two additions an LMCache config needs:

- a key written twice in one mapping is an error naming both lines (PyYAML
  keeps the last one silently, so a setting the user sees is not the one used);
- aliases may not expand the document past ``MAX_EXPANDED_NODES`` nodes: an
  alias bomb (nine anchors of nine aliases each) parses in microseconds but
  expands to hundreds of millions of values, which any later walk, print or
  copy would take minutes over. A real LMCache config has a few dozen nodes.

Errors are ``ConfigError`` lines naming ``source`` and the line. ``read_yaml_mapping``
reads a config file with it (bounded size, UTF-8, one line for every failure).
"""
from __future__ import annotations

from typing import Any, Mapping

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from lmi_cache.errors import ConfigError
from lmi_cache.plain_files import PlainFileError, read_text_file

CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
MAX_CONFIG_FILE_BYTES = 1 << 20  # an LMCache YAML is a few hundred bytes; refuse anything absurd
MAX_EXPANDED_NODES = 100_000
_MERGE_TAG = "tag:yaml.org,2002:merge"


def load_yaml(text: str, source: str) -> Any:
    """The document in ``text``; ConfigError for duplicate keys or an alias expansion past the bound.

    PyYAML's own errors (syntax, constructors) propagate for the caller's message.
    """
    loader = _StrictLoader(text)
    loader.source = source
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml_mapping(path: str) -> Mapping[str, Any]:
    """The top-level mapping of an LMCache YAML file; ConfigError (one line naming the file) otherwise.

    Read as bytes and decoded as UTF-8 here, so a bad encoding, an oversized file or
    a nesting too deep for the parser each give one clear line, never a traceback.
    """
    try:
        text = read_text_file(path, MAX_CONFIG_FILE_BYTES)
    except PlainFileError as err:
        advice = {"missing": f"fix {CONFIG_FILE_ENV} or the path given",
                  "too_large": "is this an LMCache YAML file?", "encoding": "save it as UTF-8"}
        if err.kind == "directory":
            raise ConfigError(f"{path}: is a directory, not an LMCache YAML file; name the file") from None
        raise ConfigError(f"{path}: {err}; {advice.get(err.kind, 'check the path')}") from None
    try:
        data = load_yaml(text, path)  # duplicate keys and alias bombs are ConfigErrors naming the line
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{line}; check indentation and quoting") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be an LMCache config; use flat key: value lines") from None
    except (ValueError, OverflowError, TypeError):  # PyYAML's constructors: a 5000-digit int, a bad date, ...
        raise ConfigError(f"{path}: a value cannot be read (an over-long number or a malformed date?); "
                          "write plain numbers and strings") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping of LMCache keys at the top level")
    return data


class _StrictLoader(yaml.SafeLoader):
    source = "<yaml>"

    def compose_document(self) -> Node | None:
        node = super().compose_document()
        _check_expansion(node, self.source)
        return node

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_scalar(key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"{self.source}: line {line}: key {str(key)[:60]!r} is already set on line "
                                  f"{seen[key]}; keep one of them")
            seen[key] = line
        return super().construct_mapping(node, deep)


def _check_expansion(root: Node | None, source: str) -> None:
    """Count the nodes the document expands to (an alias counts its whole target), with a memo per node."""
    if root is None:
        return
    sizes: dict[int, int] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    open_nodes: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = _children(node)
        if not children_done:
            if id(node) in open_nodes:
                raise ConfigError(f"{source}: line {node.start_mark.line + 1}: an alias refers to a value that "
                                  "contains it; write the value out")
            open_nodes.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)
            continue
        open_nodes.discard(id(node))
        sizes[id(node)] = 1 + sum(sizes.get(id(child), 0) for child in children)
        if sizes[id(node)] > MAX_EXPANDED_NODES:
            raise ConfigError(f"{source}: line {node.start_mark.line + 1}: the aliases here expand to more than "
                              f"{MAX_EXPANDED_NODES:,} values (an alias bomb?); an LMCache config needs a few dozen")


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    return []
