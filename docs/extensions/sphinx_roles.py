"""Sphinx roles in docstrings, rendered as code that links to the object where the site has it.

The docstrings are written for Sphinx: ``:func:`layergraph.list_adapters```,
``:class:`~layergraph.Adapter```, ``:meth:`plan``` and the like. Markdown alone would show the
role as text beside a code span. This griffe extension, named under mkdocstrings' ``extensions``
in ``mkdocs.yml``, rewrites every role of every docstring of a loaded package into a code span
inside an optional mkdocs-autorefs reference: a link where the target is documented on the
site, plain code where it is not. As in Sphinx, a name is looked up from the docstring's object
outwards (its members, its class, its module, imports included), ``~`` shows only the last
part of the name, ``!`` shows the name without a link, and ``title <target>`` shows the title.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Iterator
from typing import Any

from griffe import Extension, Module, NameResolutionError, Object

ROLE = re.compile(
    r":(?:py:)?(?:func|class|data|attr|meth|mod|exc|obj|const|type):`(?P<content>[^`]+)`"
)
"""A Sphinx role of the Python domain, with its content."""

_TITLED = re.compile(r"(?P<title>.*?)\s*<(?P<target>[^<>]+)>")


def render_role(content: str, resolve: Callable[[str], str]) -> str:
    """The Markdown for one role's ``content``, with ``resolve`` giving a name's full path."""
    if titled := _TITLED.fullmatch(content):
        title, target = titled["title"], titled["target"]
    else:
        title, target = None, content
    linked = not target.startswith("!")
    target = target.lstrip("!~.")
    if title is None:
        title = target.rsplit(".", 1)[-1] if content.lstrip("!").startswith("~") else target
    code = f"`{title}`"
    if not linked:
        return code
    identifier = html.escape(resolve(target.removesuffix("()")), quote=True)
    return f'<autoref identifier="{identifier}" optional>{code}</autoref>'


def render_roles(text: str, scope: Object) -> str:
    """``text`` with every Sphinx role rendered, names looked up from ``scope``."""
    resolve = _resolver(scope)
    return ROLE.sub(lambda match: render_role(match["content"], resolve), text)


def _resolver(scope: Object) -> Callable[[str], str]:
    """A function giving a dotted name's full path as seen from ``scope``, or the name itself."""

    def resolve(name: str) -> str:
        head, dot, rest = name.partition(".")
        try:
            return scope.resolve(head) + dot + rest
        except NameResolutionError:
            return name

    return resolve


def _documented(obj: Object) -> Iterator[Object]:
    """``obj`` and every object defined inside it (not those it imports)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _documented(member)


class SphinxRoles(Extension):
    """Renders the Sphinx roles of each loaded package's docstrings; see the module docstring."""

    def on_package(self, *, pkg: Module, **kwargs: Any) -> None:
        for obj in _documented(pkg):
            if obj.docstring is not None:
                obj.docstring.value = render_roles(obj.docstring.value, obj)
