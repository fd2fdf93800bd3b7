"""Tools: the safe calculator (values, errors as text, fuzzed limits), the call syntax, and
user tools built by ``_component_`` path."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from torchtune_grpo.rollout.tools.base import Tool, is_error, run_tool
from torchtune_grpo.rollout.tools.build import build_tools
from torchtune_grpo.rollout.tools.calculator import Calculator
from torchtune_grpo.rollout.tools.syntax import ToolCallSyntax

CALC = Calculator()


# ---------------------------------------------------------------------------- values
@pytest.mark.parametrize("expr, value", [
    ("12*7", "84"), ("  12 * 7 ", "84"), ("123*456", "56088"), ("2+3*4", "14"),
    ("(2+3)*4", "20"), ("-(3)", "-3"), ("+5", "5"), ("--5", "5"), ("7//2", "3"),
    ("-7//2", "-4"), ("7%3", "1"), ("-7%3", "2"), ("2**10", "1024"), ("2**-2", "0.25"),
    ("168/2", "84"), ("1/3", "0.333333333333"), ("0.1+0.2", "0.3"), ("1.5*2", "3"),
    ("1_000+1", "1001"), ("10**59", "1" + "0" * 59), ("3**0.5", "1.73205080757"),
])
def test_calculator_values(expr, value):
    assert CALC(expr) == value


@pytest.mark.parametrize("expr, message", [
    ("1/0", "division by zero"), ("5%0", "division by zero"), ("0**-1", "division by zero"),
    ("9**9**9", "exponent"), ("2**101", "exponent"), ("10**60", "digits"),
    ("10**59*10", "digits"), ("1" * 61, "digits"), ("1e308*10", "digits"),
    ("1e400", "too large"), ("0.001**-100", "digits"), ("(-8)**0.5", "real number"),
    ("__import__('os').system('ls')", "only numbers"), ("x", "only numbers"),
    ("abs(-1)", "only numbers"), ("(1).real", "only numbers"), ("[1][0]", "only numbers"),
    ("True+1", "only numbers"), ("'a'*3", "only numbers"), ("1<2", "unsupported"),
    ("~1", "unsupported"), ("1 if 1 else 2", "unsupported"), ("lambda: 1", "unsupported"),
    ("", "empty"), ("   ", "empty"), ("1+", "not an arithmetic"), ("1;2", "not an arithmetic"),
    ("12×7", "ASCII"), ("١+١", "ASCII"), ("1" + "+1" * 150, "longer than"),
    ("\x00", "not an arithmetic"),
])
def test_calculator_errors_are_text(expr, message):
    result = CALC(expr)
    assert is_error(result) and message in result, result


def test_calculator_refuses_huge_power_before_computing_it():
    start = time.perf_counter()
    for expr in ["9**9**9", "99**99", "(10**59)**2", "2**100*2**100*2**100", "-(9**99)"]:
        assert is_error(CALC(expr))
    assert time.perf_counter() - start < 0.05  # nothing was actually computed


def test_calculator_time_limit_is_enforced_between_operations():
    slow = Calculator(time_limit_s=1e-9)  # any evaluation runs past it
    assert "time limit" in slow("1+2+3")


@pytest.mark.parametrize("bad", [
    {"max_digits": 0}, {"max_exponent": -1}, {"time_limit_s": 0}, {"max_input_chars": "x"},
    {"name": ""},
])
def test_calculator_rejects_bad_limits(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Calculator(**bad)


def test_calculator_is_a_tool_and_non_text_input_is_an_error():
    assert isinstance(CALC, Tool) and CALC.name == "calculator"
    assert is_error(CALC(None))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- fuzz
TIME_LIMIT = 0.05
ADVERSARIAL = [
    "9**9**9", "9**9**9**9", "(" * 300 + "1" + ")" * 300, "(" * 99 + "1" + ")" * 99,
    "-" * 199 + "1", "1" * 5000, "2**" * 60 + "2", "10**10**10", "((9**9)**9)**9",
    "1e308**2", "-1e308*-1e308", "1/1e-320", "().__class__", "__builtins__",
    "eval('1')", "open('/etc/passwd')", "𝟏+𝟐", "１＋２", "1\u20002", "1\n+2", "\ud800",
    "99999999999999999999999999999**3", "0**0", "(-1)**0.5", "1//0.0", "7%-0.0",
    "2**-1074", "2.0**-1075", "float('inf')", "1e999-1e999", "1" + "*9" * 90,
]


def _check_call(text: str) -> None:
    start = time.perf_counter()
    result = CALC(text)
    elapsed = time.perf_counter() - start
    assert isinstance(result, str) and result
    # the limit, plus the parse of at most max_input_chars and a slack for a loaded machine
    assert elapsed < TIME_LIMIT + 0.05, (text[:80], elapsed)


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_calculator_adversarial_inputs_never_raise_nor_hang(text):
    _check_call(text)


_ARITH = st.recursive(
    st.one_of(st.integers(-10**70, 10**70).map(str),
              st.floats(allow_nan=False, allow_infinity=False).map(repr),
              st.sampled_from(["9", "99", "0", "1e308", "0.0"])),
    lambda inner: st.one_of(
        st.tuples(inner, st.sampled_from(["+", "-", "*", "/", "//", "%", "**"]), inner).map(
            lambda t: f"{t[0]}{t[1]}{t[2]}"),
        inner.map(lambda s: f"({s})"), inner.map(lambda s: f"-{s}"),
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_ARITH, st.text(max_size=300), st.text(alphabet="0123456789+-*/%()._e ",
                                                         max_size=300)))
def test_calculator_fuzz_never_raises_and_respects_time_limit(text):
    _check_call(text)


@settings(max_examples=200, deadline=None)
@given(st.integers(-10**20, 10**20), st.integers(-10**20, 10**20),
       st.sampled_from(["+", "-", "*"]))
def test_calculator_agrees_with_python_on_integers(a, b, op):
    expected = {"+": a + b, "-": a - b, "*": a * b}[op]
    assert CALC(f"{a}{op}({b})") == str(expected)


# ---------------------------------------------------------------------------- call syntax
def test_syntax_finds_the_last_completed_call_and_formats_results():
    syntax = ToolCallSyntax()
    assert syntax.format_call("calculator", "12*7") == "<calculator>12*7</calculator>"
    assert syntax.format_result("84") == "<result>84</result>"
    text = "x<calculator>1+2</calculator><result>3</result> then <calculator>5*5</calculator>"
    call = syntax.last_call(text, ["calculator"])
    assert (call.name, call.arguments, call.end) == ("calculator", "5*5", len(text))
    # a close tag whose open tag belongs to an earlier call has no arguments
    orphan = syntax.last_call("<calculator>1</calculator><result>1</result>2</calculator>",
                              ["calculator"])
    assert orphan.arguments is None
    assert syntax.last_call("no call <calculator>1+", ["calculator"]) is None
    assert syntax.count_closes(text, ["calculator", "words"]) == 2
    assert syntax.final_characters(["calculator"]) == {">"}


def test_syntax_templates_name_each_tool():
    syntax = ToolCallSyntax(call_open="[[{name}:", call_close="]]", result_open="=> ",
                            result_close=";")
    call = syntax.last_call("a [[words:one two]]", ["calculator", "words"])
    assert call.name == "calculator"  # both close with "]]": the first tool listed wins
    assert syntax.last_call("a [[words:one two]]", ["words"]).arguments == "one two"
    assert syntax.format_result("2") == "=> 2;"
    with pytest.raises(ValueError, match="call_close"):
        ToolCallSyntax(call_close="")
    with pytest.raises(ValueError, match="placeholder"):
        ToolCallSyntax(call_open="<{tool}>")


# ---------------------------------------------------------------------------- user tools
def test_user_tool_plugs_in_by_component_path():
    cfg = OmegaConf.create([
        {"_component_": "torchtune_grpo.rollout.tools.calculator.Calculator", "max_digits": 10},
        {"_component_": "_tool_components.WordCount", "prefix": "n="},
    ])
    calc, words = build_tools(cfg)
    assert isinstance(words, Tool) and words.name == "words"
    assert words("one two three") == "n=3"
    assert is_error(calc("10**10")) and calc("10**9") == "1000000000"
    assert build_tools(None) == [] and build_tools([]) == []
    # plain dicts work as well as OmegaConf nodes
    assert build_tools([{"_component_": "_tool_components.Shouting"}])[0].name == "shout"


@pytest.mark.parametrize("entries, message", [
    ({"_component_": "torchtune_grpo.rollout.tools.calculator.Calculator"}, "must be a list"),
    (["calculator"], r"tools\[0\]' must be a mapping"),
    ([{"_component_": "torchtune_grpo.rollout.tools.calculator.Calculator"}, {"max_digits": 3}],
     r"tools\[1\]'._component_ is missing"),
    ([{"_component_": "no_such_module.Tool"}], r"tools\[0\]'._component_='no_such_module"),
    ([{"_component_": "torchtune_grpo.rollout.tools.calculator.Calculator", "max_digits": -1}],
     r"tools\[0\].*max_digits"),
    ([{"_component_": "_tool_components.not_a_tool"}], r"tools\[0\].*'name'"),
    ([{"_component_": "_tool_components.WordCount"},
      {"_component_": "_tool_components.WordCount"}], r"tools\[1\]'.name='words'.*tools\[0\]"),
])
def test_build_tools_names_the_bad_entry(entries, message):
    with pytest.raises(ValueError, match=message):
        build_tools(entries)


def test_run_tool_turns_exceptions_and_non_text_into_errors():
    from _tool_components import Shouting

    assert run_tool(Shouting(), "hi") == "HI"
    assert run_tool(Shouting(), "") == "error: RuntimeError: nothing to shout"

    class Bad:
        name = "bad"

        def __call__(self, arguments):
            return 42

    assert is_error(run_tool(Bad(), "x"))
