import math

import pytest

from controllers.validation import number_problem, require_number


@pytest.mark.parametrize("value, kwargs, expected", [
    (1.0, {}, None),
    (0.0, {}, None),
    (math.nan, {}, "x=nan"),
    (math.inf, {}, "x=inf"),
    (-1.0, {}, "x=-1 is < 0"),
    (0.0, {"strictly_positive": True}, "x=0 is not > 0"),
    (2.0, {"maximum": 1.0}, "x=2 is > 1"),
    (None, {}, "x=None is not a number"),
    (True, {}, "x=True is not a number"),
])
def test_number_problem(value, kwargs, expected):
    assert number_problem("x", value, **kwargs) == expected


def test_require_number_names_the_input_and_the_fix():
    assert require_number("cost_s", 3) == 3.0
    with pytest.raises(ValueError, match=r"cost_s=nan; pass a finite number > 0"):
        require_number("cost_s", math.nan, strictly_positive=True)
