"""A small PromQL parser for checking the queries of a Grafana dashboard against real metrics.

It reads what a dashboard's expressions are built from (selectors with their matchers,
function calls, aggregations with their grouping, binary operators with their vector
matching) into a tree, so a check can tell a metric name from a function, an aggregation
keyword, a label inside `{}` or `by (...)`, a number or a Grafana variable (`$__rate_interval`,
`${datasource}`, `$instance`, which it keeps as they are: Grafana substitutes them before
Prometheus parses anything). It knows the grammar the dashboard needs (Prometheus 2.x/3.x
without `offset` or `@` modifiers); anything else is a `PromQLError`, never a silent skip, so a query the
parser misreads fails the test instead of passing unchecked.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

AGGREGATIONS = frozenset(
    {
        "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
        "bottomk", "topk", "quantile", "limitk", "limit_ratio",
    }
)  # fmt: skip
FUNCTIONS = frozenset(
    {
        "abs", "absent", "absent_over_time", "avg_over_time", "ceil", "changes", "clamp",
        "clamp_max", "clamp_min", "count_over_time", "day_of_month", "day_of_week",
        "day_of_year", "days_in_month", "delta", "deriv", "exp", "floor", "histogram_avg",
        "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev",
        "histogram_stdvar", "histogram_sum", "hour", "idelta", "increase", "irate",
        "label_join", "label_replace", "last_over_time", "ln", "log10", "log2",
        "max_over_time", "min_over_time", "minute", "month", "predict_linear",
        "present_over_time", "quantile_over_time", "rate", "resets", "round", "scalar", "sgn",
        "sort", "sort_by_label", "sort_by_label_desc", "sort_desc", "sqrt", "stddev_over_time",
        "stdvar_over_time", "sum_over_time", "time", "timestamp", "vector", "year",
    }
)  # fmt: skip
SET_OPERATORS = frozenset({"and", "or", "unless"})
PRECEDENCE = {
    "or": 1, "and": 2, "unless": 2,
    "==": 3, "!=": 3, ">=": 3, "<=": 3, ">": 3, "<": 3,
    "+": 4, "-": 4, "*": 5, "/": 5, "%": 5, "^": 6,
}  # fmt: skip
MATCH_OPERATORS = ("=~", "!~", "!=", "=")

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<range>\[[^\]]*\])
  | (?P<variable>\$\{\w+(?::\w+)?\}|\$\w+)
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|==|!=|>=|<=|[-+*/%^<>=(){},])
    """,
    re.VERBOSE,
)


class PromQLError(ValueError):
    """An expression this parser does not read: the check fails rather than skip it."""


@dataclass(frozen=True)
class Token:
    kind: str
    text: str


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str
    value: str  # unquoted; may hold Grafana variables


@dataclass(frozen=True)
class Selector:
    metric: str
    matchers: tuple[Matcher, ...]
    range: str | None  # "[$__rate_interval]", or None for an instant vector


@dataclass(frozen=True)
class Call:
    function: str
    args: tuple[Node, ...]


@dataclass(frozen=True)
class Aggregation:
    operator: str
    grouping: tuple[str, ...]
    without: bool
    args: tuple[Node, ...]


@dataclass(frozen=True)
class Binary:
    operator: str
    left: Node
    right: Node
    matching: tuple[str, ...]  # the labels of on/ignoring/group_left/group_right


@dataclass(frozen=True)
class Literal:
    text: str  # a number, a string or a Grafana variable standing for one


Node = Selector | Call | Aggregation | Binary | Literal


def tokens(expr: str) -> list[Token]:
    found: list[Token] = []
    position = 0
    while position < len(expr):
        match = _TOKEN.match(expr, position)
        if match is None:
            raise PromQLError(f"cannot read {expr[position:]!r} in {expr!r}")
        kind = match.lastgroup
        assert kind is not None
        if kind != "space":
            found.append(Token(kind, match.group()))
        position = match.end()
    return found


def parse(expr: str) -> Node:
    parser = _Parser(tokens(expr), expr)
    node = parser.expression(0)
    if parser.peek() is not None:
        raise PromQLError(f"unexpected {parser.peek()!r} in {expr!r}")
    return node


def walk(node: Node) -> Iterator[Node]:
    yield node
    if isinstance(node, Call | Aggregation):
        for arg in node.args:
            yield from walk(arg)
    elif isinstance(node, Binary):
        yield from walk(node.left)
        yield from walk(node.right)


def selectors(node: Node) -> list[Selector]:
    return [n for n in walk(node) if isinstance(n, Selector)]


class _Parser:
    def __init__(self, found: list[Token], expr: str) -> None:
        self.tokens = found
        self.expr = expr
        self.position = 0

    def peek(self, ahead: int = 0) -> Token | None:
        index = self.position + ahead
        return self.tokens[index] if index < len(self.tokens) else None

    def at(self, *texts: str) -> bool:
        token = self.peek()
        return token is not None and token.text in texts

    def take(self, text: str | None = None) -> Token:
        token = self.peek()
        if token is None or (text is not None and token.text != text):
            raise PromQLError(f"expected {text or 'more'} at {token!r} in {self.expr!r}")
        self.position += 1
        return token

    def expression(self, floor: int) -> Node:
        """Precedence climbing; `^` is right-associative, every other operator left."""
        left = self.unary()
        while (token := self.peek()) is not None and PRECEDENCE.get(token.text, 0) > floor:
            operator = self.take().text
            if self.at("bool"):
                self.take()
            matching = self.vector_matching()
            right_floor = PRECEDENCE[operator] - (1 if operator == "^" else 0)
            left = Binary(operator, left, self.expression(right_floor), matching)
        return left

    def vector_matching(self) -> tuple[str, ...]:
        labels: list[str] = []
        while self.at("on", "ignoring", "group_left", "group_right"):
            self.take()
            if self.at("("):
                labels.extend(self.label_list())
        return tuple(labels)

    def unary(self) -> Node:
        if self.at("-", "+"):  # a sign changes no metric, label or grouping
            self.take()
            return self.unary()
        return self.primary()

    def primary(self) -> Node:
        token = self.take()
        if token.kind in ("number", "string", "variable"):
            return Literal(token.text)
        if token.text == "(":
            inner = self.expression(0)
            self.take(")")
            return inner
        if token.kind != "ident":
            raise PromQLError(f"unexpected {token.text!r} in {self.expr!r}")
        if token.text in AGGREGATIONS:
            return self.aggregation(token.text)
        if self.at("("):
            if token.text not in FUNCTIONS:
                raise PromQLError(f"unknown function {token.text!r} in {self.expr!r}")
            return Call(token.text, self.arguments())
        if token.text in SET_OPERATORS or token.text in ("by", "without", "bool", "offset"):
            raise PromQLError(f"keyword {token.text!r} where a value belongs in {self.expr!r}")
        return self.selector(token.text)

    def aggregation(self, operator: str) -> Aggregation:
        grouping: tuple[str, ...] = ()
        without = False
        if self.at("by", "without"):
            without = self.take().text == "without"
            grouping = self.label_list()
        args = self.arguments()
        if self.at("by", "without"):
            if grouping:
                raise PromQLError(f"two groupings for {operator} in {self.expr!r}")
            without = self.take().text == "without"
            grouping = self.label_list()
        return Aggregation(operator, grouping, without, args)

    def arguments(self) -> tuple[Node, ...]:
        self.take("(")
        args: list[Node] = []
        while not self.at(")"):
            args.append(self.expression(0))
            if self.at(","):
                self.take()
        self.take(")")
        return tuple(args)

    def label_list(self) -> tuple[str, ...]:
        self.take("(")
        labels: list[str] = []
        while (token := self.take()).text != ")":
            if token.text == ",":
                continue
            if token.kind != "ident":
                raise PromQLError(f"{token.text!r} is no label name in {self.expr!r}")
            labels.append(token.text)
        return tuple(labels)

    def selector(self, metric: str) -> Selector:
        matchers: list[Matcher] = []
        if self.at("{"):
            self.take()
            while (token := self.take()).text != "}":
                if token.text == ",":
                    continue
                if token.kind != "ident":
                    raise PromQLError(f"{token.text!r} is no label name in {self.expr!r}")
                op = self.take().text
                if op not in MATCH_OPERATORS:
                    raise PromQLError(f"{op!r} is no matcher in {self.expr!r}")
                value = self.take()
                if value.kind != "string":
                    raise PromQLError(f"matcher value {value.text!r} unquoted in {self.expr!r}")
                matchers.append(Matcher(token.text, op, value.text[1:-1]))
        window = None
        following = self.peek()
        if following is not None and following.kind == "range":
            window = self.take().text
        if self.at("offset"):
            raise PromQLError(f"offset is not supported in {self.expr!r}")
        return Selector(metric, tuple(matchers), window)
