"""Safe expressions in the data files (family parameter terms, re-targeting configs and conditions):
parsed with ``ast`` and evaluated by walking the tree, so a definition cannot run code."""

from __future__ import annotations

import ast
import operator
from typing import Any

from mha2gqa.core.errors import Mha2GqaError

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CMPOPS = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}


def evaluate_expression(expr: str, config: dict[str, Any]) -> Any:
    """A config expression: source keys (``rope_parameters.rope_theta`` reads into a dict; a missing
    key is None), numbers, strings, ``+ - * / // %``, ``or``, ``and``, ``not``, ``== != is < <= > >=`` and
    ``x if c else y``. Nothing else parses, so a definition cannot run code."""

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return config.get(node.id)
        if isinstance(node, ast.Attribute):
            base = ev(node.value)
            return base.get(node.attr) if isinstance(base, dict) else None
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.BoolOp):
            values = [ev(v) for v in node.values]
            if isinstance(node.op, ast.Or):
                return next((v for v in values if v), values[-1])
            return next((v for v in values if not v), values[-1])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return not ev(node.operand)
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMPOPS:
            return _CMPOPS[type(node.ops[0])](ev(node.left), ev(node.comparators[0]))
        if isinstance(node, ast.IfExp):
            return ev(node.body) if ev(node.test) else ev(node.orelse)
        raise ValueError(f"unsupported expression {ast.dump(node)[:60]}")

    try:
        return ev(ast.parse(expr, mode="eval"))
    except (TypeError, ZeroDivisionError, AttributeError) as e:  # a config value of the wrong kind
        shown = ", ".join(f"{n} {config.get(n)!r:.30}" for n in names_in(expr) if n in config) or "missing values"
        raise ExpressionError(f"config.json: {shown}: not usable here ({type(e).__name__}: {e})") from None


class ExpressionError(Mha2GqaError, ValueError):
    """An expression could not be evaluated on a config: the config's values are of the wrong kind."""


def names_in(expr: str) -> list[str]:
    """The config keys ``expr`` reads (the first part of a dotted one), in order, once each."""
    names = [n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)]
    return list(dict.fromkeys(names))


_ALLOWED = (
    ast.Expression,
    ast.Constant,
    ast.Name,
    ast.Load,
    ast.Attribute,
    ast.BinOp,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.UnaryOp,
    ast.Not,
    ast.Compare,
    ast.IfExp,
    *_BINOPS,
    *_CMPOPS,
)


def check_expression(expr: str, fail) -> None:
    """``expr`` uses only what :func:`evaluate_expression` reads; ``fail(msg)`` builds the error otherwise."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise fail(f"expression {expr!r} does not parse") from None
    bad = next((n for n in ast.walk(tree) if not isinstance(n, _ALLOWED)), None)
    if bad is not None:
        raise fail(f"expression {expr!r} uses {type(bad).__name__}, which definitions may not")
