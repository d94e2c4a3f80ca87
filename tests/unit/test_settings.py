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
        ({"ZB_PATCH": "1", "ZB_PATCH_ENABLE": "no-such-patch"}, "ZB_PATCH_ENABLE"),
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


def test_enable_takes_opt_in_patch_ids_and_lists_them_when_wrong():
    s = Settings(
        {"ZB_PATCH": "1", "ZB_PATCH_ENABLE": "full-replay-ordered-on-device, piecewise-replay-without-host-drain"}
    )
    assert s.errors == [] and s.opted_in == {"full-replay-ordered-on-device", "piecewise-replay-without-host-drain"}
    assert Settings({"ZB_PATCH": "1", "ZB_PATCH_ENABLE": "*"}).opted_in == {"*"}
    (err,) = Settings({"ZB_PATCH": "1", "ZB_PATCH_ENABLE": "full-replay-ordered"}).errors
    assert err.startswith("ZB_PATCH_ENABLE='full-replay-ordered': unknown opt-in patch id(s) full-replay-ordered ")
    assert err.endswith(
        "(valid: * or full-replay-ordered-on-device, full-replay-ordered-on-device-attn-dcp-pcp, "
        "full-replay-ordered-on-device-mla-attn, full-replay-ordered-on-device-mla-attn-dcp-pcp, "
        "piecewise-replay-without-host-drain)"
    )
    (err,) = Settings({"ZB_PATCH": "1", "ZB_PATCH_ENABLE": "stale-draft-placeholders"}).errors
    assert "applied by default, not opt-in: stale-draft-placeholders" in err


def test_enable_and_disable_may_not_name_the_same_patch():
    env = {"ZB_PATCH": "1", "ZB_PATCH_ENABLE": "piecewise-replay-without-host-drain"}
    (err,) = Settings({**env, "ZB_PATCH_DISABLE": "piecewise-replay-without-host-drain"}).errors
    assert err == (
        "ZB_PATCH_ENABLE and ZB_PATCH_DISABLE both name piecewise-replay-without-host-drain: name each in one"
    )


def test_every_variable_is_documented():
    assert set(ENV_VARS) == {"ZB_PATCH", "ZB_PATCH_DISABLE", "ZB_PATCH_ENABLE", "ZB_PATCH_STRICT"}
    assert all(ENV_VARS.values())
