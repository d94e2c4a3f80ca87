import pytest

from zb_patch.plugin import ENV_VARS, Settings


def test_off_by_default():
    s = Settings({})
    assert not s.enabled and not s.strict and not s.disabled and not s.errors


@pytest.mark.parametrize(
    "env, enabled, strict",
    [
        ({"ZB_PATCH": "1"}, True, False),
        ({"ZB_PATCH": "0"}, False, False),
        ({"ZB_PATCH": " 1 "}, True, False),
        ({"ZB_PATCH": "1", "ZB_PATCH_STRICT": "1"}, True, True),
        ({"ZB_PATCH": "1", "ZB_PATCH_STRICT": ""}, True, False),
    ],
)
def test_valid_values(env, enabled, strict):
    s = Settings(env)
    assert (s.enabled, s.strict, s.errors) == (enabled, strict, [])


@pytest.mark.parametrize(
    "env, var",
    [
        ({"ZB_PATCH": "yes"}, "ZB_PATCH"),
        ({"ZB_PATCH": "true"}, "ZB_PATCH"),
        ({"ZB_PATCH": "1", "ZB_PATCH_STRICT": "on"}, "ZB_PATCH_STRICT"),
        ({"ZB_PATCH": "1", "ZB_PATCH_DISABEL": "x"}, "ZB_PATCH_DISABEL"),
        ({"ZB_PATCH": "1", "ZB_PATCH_DISABLE": "no-such-patch"}, "ZB_PATCH_DISABLE"),
    ],
)
def test_invalid_values_name_the_variable_and_valid_values(env, var):
    s = Settings(env)
    assert len(s.errors) == 1
    err = s.errors[0]
    assert err.startswith(var)
    assert "valid:" in err


def test_invalid_switch_stays_off():
    assert not Settings({"ZB_PATCH": "2"}).enabled


def test_disable_all_and_list():
    assert Settings({"ZB_PATCH": "1", "ZB_PATCH_DISABLE": "*"}).disabled == {"*"}
    assert Settings({"ZB_PATCH": "1", "ZB_PATCH_DISABLE": " , "}).disabled == frozenset()


def test_every_variable_is_documented():
    assert set(ENV_VARS) == {"ZB_PATCH", "ZB_PATCH_DISABLE", "ZB_PATCH_STRICT"}
    assert all(ENV_VARS.values())
