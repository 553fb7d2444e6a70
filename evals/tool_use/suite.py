"""The tools of the tool-use eval: typed Python functions, as a user would write them.

Ten tools: unit conversions, arithmetic, dates, a key-value lookup, a tool with an enum and
a nested object, one that raises, one that times out; the built-in document search is
added by the eval when an index is given. Results are deterministic (a fixed table, no
clock, no network), so every task has one right answer.
"""

from __future__ import annotations

import ast
import datetime
import operator
import time
from typing import Literal

from pydantic import BaseModel, Field

from specrag.tools import Tool, tool

COUNTRIES = {
    "france": {"capital": "Paris", "population": "68 million", "currency": "euro"},
    "japan": {"capital": "Tokyo", "population": "124 million", "currency": "yen"},
    "peru": {"capital": "Lima", "population": "34 million", "currency": "sol"},
    "kenya": {"capital": "Nairobi", "population": "55 million", "currency": "Kenyan shilling"},
    "norway": {"capital": "Oslo", "population": "5.5 million", "currency": "Norwegian krone"},
    "canada": {"capital": "Ottawa", "population": "40 million", "currency": "Canadian dollar"},
    "vietnam": {"capital": "Hanoi", "population": "100 million", "currency": "dong"},
    "chile": {"capital": "Santiago", "population": "19.6 million", "currency": "Chilean peso"},
}
STOCKS = {"ACME": 123.45, "GLOBEX": 67.8, "INITECH": 8.25}
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
}


@tool
def convert_temperature(value: float, unit: Literal["celsius", "fahrenheit"]) -> str:
    """Convert a temperature from the given unit to the other one.

    Args:
        value: The temperature.
        unit: The unit the value is in.
    """
    if unit == "celsius":
        return f"{value * 9 / 5 + 32:.1f} fahrenheit"
    return f"{(value - 32) * 5 / 9:.1f} celsius"


@tool
def convert_length(
    value: float, from_unit: Literal["km", "mile", "m", "foot"], to_unit: Literal["km", "mile", "m", "foot"]
) -> str:
    """Convert a length between kilometres, miles, metres and feet.

    Args:
        value: The length.
        from_unit: The unit the value is in.
        to_unit: The unit to convert to.
    """
    metres = {"km": 1000.0, "mile": 1609.344, "m": 1.0, "foot": 0.3048}
    return f"{value * metres[from_unit] / metres[to_unit]:.2f} {to_unit}"


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / ** % and parentheses.

    Args:
        expression: The expression, for example "(3 + 4) * 12".
    """
    return f"{_evaluate(ast.parse(expression, mode='eval').body):g}"


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only numbers and + - * / ** % are allowed")


@tool
def days_between(start: str, end: str) -> str:
    """Count the days from one date to another.

    Args:
        start: The first date, YYYY-MM-DD.
        end: The second date, YYYY-MM-DD.
    """
    days = (datetime.date.fromisoformat(end) - datetime.date.fromisoformat(start)).days
    return f"{days} days"


@tool
def add_days(date: str, days: int) -> str:
    """The date a number of days after (or before, if negative) a date.

    Args:
        date: The date, YYYY-MM-DD.
        days: How many days to add.
    """
    shifted = datetime.date.fromisoformat(date) + datetime.timedelta(days=days)
    return f"{shifted.isoformat()} ({shifted.strftime('%A')})"


@tool
def country_fact(country: str, fact: Literal["capital", "population", "currency"]) -> str:
    """Look up a fact about a country in the reference table.

    Args:
        country: The country's name.
        fact: Which fact.
    """
    row = COUNTRIES.get(country.strip().lower())
    if row is None:
        return f"no entry for {country!r}; known: {', '.join(sorted(name.title() for name in COUNTRIES))}"
    return f"{fact} of {country.title()}: {row[fact]}"


class Attendee(BaseModel):
    name: str = Field(description="The attendee's name.")
    email: str = Field(description="The attendee's email address.")


@tool
def book_meeting(room: Literal["red", "blue", "green"], start: str, attendees: list[Attendee]) -> str:
    """Book a meeting room.

    Args:
        room: Which room.
        start: Start time, HH:MM.
        attendees: Who comes.
    """
    names = ", ".join(attendee.name for attendee in attendees)
    return f"booked the {room} room at {start} for {len(attendees)} ({names})"


@tool
def stock_price(symbol: str) -> str:
    """The latest price of a stock.

    Args:
        symbol: The ticker symbol, for example ACME.
    """
    if symbol.upper() not in STOCKS:
        raise KeyError(f"unknown ticker symbol {symbol!r}")
    return f"{symbol.upper()}: {STOCKS[symbol.upper()]} USD"


@tool(timeout_s=1.0)
def live_weather(city: str) -> str:
    """The current weather in a city, from a live weather service.

    Args:
        city: The city.
    """
    time.sleep(3.0)  # the service never answers in time
    return f"sunny in {city}"


def eval_tools() -> list[Tool]:
    return [
        convert_temperature,
        convert_length,
        calculator,
        days_between,
        add_days,
        country_fact,
        book_meeting,
        stock_price,
        live_weather,
    ]
