import os
import sys

import pytest

from zb_patch import registry as R
from zb_patch.registry import Guard, Patch, PatchSet, fingerprint_object

RESTS = R.RestsOn(R.HOST, "the test's own code")


def _patch(upstream, qual, make, pid="p", fps=None, **kw):
    mod = upstream.load()
    owner = mod
    parts = qual.split(".")
    for p in parts[:-1]:
        owner = owner.__dict__[p]
    fp = fingerprint_object(owner.__dict__[parts[-1]])
    kw.setdefault("rests_on", RESTS)
    return Patch(
        id=pid,
        target=upstream.target(qual),
        make=make,
        fingerprints=fps if fps is not None else {"test": fp},
        why="test",
        upstream=("#0",),
        remove_when="never",
        **kw,
    )


def _double_step(orig):
    def step(self, x):
        return orig(self, x) * 10

    return step


def test_apply_replaces_and_unpatch_restores_identity(upstream):
    mod = upstream.load()
    original = mod.Runner.__dict__["step"]
    ps = PatchSet("t", [_patch(upstream, "Runner.step", _double_step)])
    rep = ps.apply()
    assert rep.verdict == R.APPLIED, rep.reason
    assert mod.Runner().step(3) == 60
    live = mod.Runner.__dict__["step"]
    assert getattr(live, R.MARK_ID) == "p"
    assert getattr(live, R.MARK_ORIGINAL) is original
    assert getattr(live, R.MARK_PID) == os.getpid()
    assert ps.unpatch() == ["p"]
    assert mod.Runner.__dict__["step"] is original
    assert mod.Runner().step(3) == 6
    assert ps.unpatch() == []  # nothing left to undo


def test_second_apply_is_already_applied_not_double_wrapped(upstream):
    mod = upstream.load()
    ps = PatchSet("t", [_patch(upstream, "Runner.step", _double_step)])
    assert ps.apply().verdict == R.APPLIED
    rep = ps.apply()
    assert rep.verdict == R.ALREADY
    assert "earlier in this process" in rep.items[0].reason
    assert mod.Runner().step(1) == 20  # wrapped once


def test_fingerprint_mismatch_applies_nothing_and_names_both_fingerprints(upstream):
    mod = upstream.load()
    orig_step, orig_prep = mod.Runner.__dict__["step"], mod.Runner.__dict__["prepare"]
    good = _patch(upstream, "Runner.step", _double_step, pid="a")
    bad = _patch(upstream, "Runner.prepare", lambda o: o, pid="b", fps={"rel 1.0": "0123456789abcdef"})
    rep = PatchSet("t", [good, bad]).apply()
    assert rep.verdict == R.REFUSED
    found = fingerprint_object(orig_prep)
    assert upstream.target("Runner.prepare") in rep.reason
    assert "0123456789abcdef (rel 1.0)" in rep.reason and found in rep.reason
    assert {i.id: i.verdict for i in rep.items} == {"a": R.REFUSED, "b": R.REFUSED}
    assert mod.Runner.__dict__["step"] is orig_step and mod.Runner.__dict__["prepare"] is orig_prep


def test_guard_mismatch_refuses_the_whole_set(upstream):
    mod = upstream.load()
    orig = mod.Runner.__dict__["step"]
    ps = PatchSet(
        "t",
        [_patch(upstream, "Runner.step", _double_step)],
        [Guard(upstream.target("Runner.prepare"), {"x": "ffffffffffffffff"})],
    )
    rep = ps.apply()
    assert rep.verdict == R.REFUSED and "Runner.prepare" in rep.reason
    assert mod.Runner.__dict__["step"] is orig


def test_failure_while_applying_rolls_back(upstream):
    mod = upstream.load()
    orig_step, orig_prep = mod.Runner.__dict__["step"], mod.Runner.__dict__["prepare"]

    def boom(orig):
        raise RuntimeError("factory failed")

    ps = PatchSet(
        "t", [_patch(upstream, "Runner.step", _double_step, pid="a"), _patch(upstream, "Runner.prepare", boom, pid="b")]
    )
    rep = ps.apply()
    assert rep.verdict == R.REFUSED and "rolled back" in rep.reason and "factory failed" in rep.reason
    assert mod.Runner.__dict__["step"] is orig_step
    assert mod.Runner.__dict__["prepare"] is orig_prep


def test_inherited_attribute_is_not_found_on_subclass(upstream):
    upstream.load()
    p = Patch(
        id="x",
        target=upstream.target("Runner.inherited"),
        make=lambda o: o,
        fingerprints={"a": "0" * 16},
        why="",
        upstream=(),
        remove_when="",
        rests_on=RESTS,
    )
    rep = PatchSet("t", [p]).apply()
    assert rep.verdict == R.REFUSED
    assert "inherited from" in rep.reason and ".Base" in rep.reason


def test_a_class_rebound_to_a_subclass_elsewhere_is_resolved_to_its_own_definition(upstream):
    """vllm-ascend's platform patch sets ``vllm.v1.core.sched.scheduler.Scheduler = BalanceScheduler`` (a subclass
    defined in its own module): a target names the module's own class, whose source the fingerprints were read from;
    the patch goes there, the subclass reaches it, and undo restores it."""
    mod = upstream.load()
    original = mod.Runner.__dict__["step"]
    upstream.write("balance", f"from {upstream.mod()} import Runner\n\nclass Runner(Runner):\n    pass\n")
    rebound = upstream.load("balance").Runner
    ps = PatchSet("t", [_patch(upstream, "Runner.step", _double_step)])
    mod.Runner = rebound
    try:
        res = R.resolve(upstream.target("Runner.step"))
        assert res.found and res.owner is rebound.__mro__[1] and res.original is original, res.reason
        assert ps.apply().verdict == R.APPLIED
        assert rebound().step(3) == 60 and "step" not in rebound.__dict__
        assert ps.unpatch() == ["p"] and rebound.__mro__[1].__dict__["step"] is original
    finally:
        mod.Runner = rebound.__mro__[1]


def test_missing_target_and_bad_spec(upstream):
    upstream.load()
    p = Patch(
        id="x",
        target=upstream.target("Runner.nope"),
        make=lambda o: o,
        fingerprints={"a": "0" * 16},
        why="",
        upstream=(),
        remove_when="",
        rests_on=RESTS,
    )
    assert PatchSet("t", [p]).apply().verdict == R.REFUSED
    with pytest.raises(ValueError):
        R.split_target("no_colon.here")
    with pytest.raises(ValueError):
        Patch(
            id="y", target="a:b", make=lambda o: o, fingerprints={}, why="", upstream=(), remove_when="", rests_on=RESTS
        )
    with pytest.raises(ValueError):
        Patch(
            id="y",
            target="a:b",
            make=lambda o: o,
            fingerprints={"a": "b"},
            why="",
            upstream=(),
            remove_when="",
            roles=("gpu",),
            rests_on=RESTS,
        )


def test_pending_when_module_not_imported(upstream):
    p = Patch(
        id="x",
        target=upstream.target("Runner.step"),
        make=_double_step,
        fingerprints={"a": "0" * 16},
        why="",
        upstream=(),
        remove_when="",
        rests_on=RESTS,
    )
    rep = PatchSet("t", [p]).apply()
    assert rep.verdict == R.PENDING
    assert upstream.mod() not in sys.modules  # apply never imports


def test_staticmethod_and_classmethod_targets(upstream):
    mod = upstream.load()
    raw_pure = mod.Runner.__dict__["pure"]
    ps = PatchSet(
        "t", [_patch(upstream, "Runner.pure", lambda o: staticmethod(lambda a, b: o.__func__(a, b) + 100), pid="s")]
    )
    assert ps.apply().verdict == R.APPLIED
    assert mod.Runner.pure(5, 3) == 102
    ps.unpatch()
    assert mod.Runner.__dict__["pure"] is raw_pure


def test_aliases_are_rebound_verified_and_restored(upstream):
    mod = upstream.load()
    user = upstream.load("user")
    original = mod.helper
    p = _patch(upstream, "helper", lambda o: lambda x: o(x) * 100, pid="h", aliases=(f"{upstream.mod('user')}:helper",))
    ps = PatchSet("t", [p])
    assert ps.apply().verdict == R.APPLIED
    assert user.use(1) == 200 and mod.helper(1) == 200
    ps.unpatch()
    assert mod.helper is original and user.helper is original


def test_alias_drift_refuses(upstream):
    upstream.load()
    user = upstream.load("user")
    user.helper = lambda x: x  # someone else rebound it
    p = _patch(upstream, "helper", lambda o: o, pid="h", aliases=(f"{upstream.mod('user')}:helper",))
    rep = PatchSet("t", [p]).apply()
    assert rep.verdict == R.REFUSED and "alias" in rep.reason


def test_native_and_disabled_verdicts(upstream):
    mod = upstream.load()
    orig = mod.Runner.__dict__["step"]
    native = _patch(upstream, "Runner.step", _double_step, pid="n", native=lambda v: "release has it")
    other = _patch(upstream, "Runner.prepare", lambda o: lambda self, n: [], pid="d")
    ps = PatchSet("t", [native, other])
    rep = ps.apply(versions=object(), disabled={"d"})
    assert {i.id: i.verdict for i in rep.items} == {"n": R.NATIVE, "d": R.DISABLED}
    assert mod.Runner.__dict__["step"] is orig
    assert mod.Runner().prepare(2) == [0, 1]
    rep = ps.apply(versions=object(), disabled={"*"})
    assert rep.by_verdict(R.DISABLED) == ["n", "d"]


def test_duplicate_ids_or_targets_rejected(upstream):
    upstream.load()
    a = _patch(upstream, "Runner.step", _double_step, pid="a")
    with pytest.raises(ValueError):
        PatchSet("t", [a, a])


def test_applied_state_survives_fork_as_inherited(upstream):
    mod = upstream.load()
    ps = PatchSet("t", [_patch(upstream, "Runner.step", _double_step)])
    assert ps.apply().verdict == R.APPLIED
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: live state says applied by the parent; nothing is applied twice
        try:
            rep = ps.apply()
            ok = (
                rep.verdict == R.ALREADY
                and "inherited from parent" in rep.items[0].reason
                and mod.Runner().step(1) == 20
            )
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"


def test_native_fingerprint_means_the_fix_is_already_there(upstream):
    mod = upstream.load()
    orig = mod.Runner.__dict__["step"]
    fp = fingerprint_object(orig)
    p = Patch(
        id="fix",
        target=upstream.target("Runner.step"),
        make=_double_step,
        fingerprints={"buggy 1.0": "0123456789abcdef"},
        native_fingerprints={"fixed 2.0": fp},
        why="w",
        upstream=("#1",),
        remove_when="r",
        rests_on=RESTS,
    )
    rep = PatchSet("t", [p]).apply()
    assert rep.verdict == R.OK, rep.reason
    item = rep.items[0]
    assert (item.verdict, item.matched) == (R.NATIVE, "fixed 2.0") and "already carries" in item.reason
    assert mod.Runner.__dict__["step"] is orig


def test_neither_buggy_nor_fixed_form_refuses(upstream):
    upstream.load()
    p = Patch(
        id="fix",
        target=upstream.target("Runner.step"),
        make=_double_step,
        fingerprints={"buggy 1.0": "0123456789abcdef"},
        native_fingerprints={"fixed 2.0": "fedcba9876543210"},
        why="w",
        upstream=("#1",),
        remove_when="r",
        rests_on=RESTS,
    )
    assert PatchSet("t", [p]).apply().verdict == R.REFUSED


def test_advisory_warns_without_blocking(upstream):
    mod = upstream.load()
    fp = fingerprint_object(mod.Runner.__dict__["prepare"])
    adv = R.Advisory(
        id="#42",
        target=upstream.target("Runner.prepare"),
        affected={"rel 1.0": fp},
        message="known bug",
        upstream=("#42",),
    )
    other = R.Advisory(
        id="#43", target=upstream.target("Runner.step"), affected={"rel 0.9": "0" * 16}, message="other bug"
    )
    ps = PatchSet("t", [_patch(upstream, "Runner.step", _double_step)], advisories=[adv, other])
    rep = ps.apply()
    assert rep.verdict == R.APPLIED
    verdicts = {i.id: (i.kind, i.verdict) for i in rep.items}
    assert verdicts["#42"] == ("advisory", R.ADVISORY) and verdicts["#43"] == ("advisory", R.OK)


def test_a_patch_is_not_applied_without_the_patch_it_requires(upstream):
    mod = upstream.load()
    orig_step, orig_prep = mod.Runner.__dict__["step"], mod.Runner.__dict__["prepare"]
    base = _patch(upstream, "Runner.step", _double_step, pid="base")
    needs = _patch(upstream, "Runner.prepare", lambda o: lambda self, n: [], pid="needs", requires=("base",))
    rep = PatchSet("t", [base, needs]).apply(disabled={"base"})
    v = {i.id: (i.verdict, i.reason) for i in rep.items}
    assert v["base"] == (R.DISABLED, "disabled by ZB_PATCH_DISABLE")
    assert v["needs"][0] == R.DISABLED and "needs base, which is not applied" in v["needs"][1]
    assert mod.Runner.__dict__["step"] is orig_step and mod.Runner.__dict__["prepare"] is orig_prep
    ps = PatchSet("t", [base, needs])
    rep = ps.apply(disabled={"needs"})  # one direction only: the required patch stays
    assert {i.id: i.verdict for i in rep.items} == {"base": R.APPLIED, "needs": R.DISABLED}
    ps.unpatch()


def test_a_required_patch_is_listed_first(upstream):
    base = _patch(upstream, "Runner.step", _double_step, pid="base")
    needs = _patch(upstream, "Runner.prepare", lambda o: o, pid="needs", requires=("base",))
    with pytest.raises(ValueError, match="needs names base, which is not listed before it"):
        PatchSet("t", [needs, base])


def test_disabling_one_patch_of_a_group_disables_the_group(upstream):
    mod = upstream.load()
    orig_step, orig_prep = mod.Runner.__dict__["step"], mod.Runner.__dict__["prepare"]
    a = _patch(upstream, "Runner.step", _double_step, pid="a", group="g")
    b = _patch(upstream, "Runner.prepare", lambda o: lambda self, n: [], pid="b", group="g")
    c = _patch(upstream, "Runner.pure", lambda o: o, pid="c")
    rep = PatchSet("t", [a, b, c]).apply(disabled={"b"})
    v = {i.id: (i.verdict, i.reason) for i in rep.items}
    assert v["b"] == (R.DISABLED, "disabled by ZB_PATCH_DISABLE")
    assert v["a"][0] == R.DISABLED and "disabled with b" in v["a"][1] and "group 'g'" in v["a"][1]
    assert v["c"][0] == R.APPLIED
    assert mod.Runner.__dict__["step"] is orig_step and mod.Runner.__dict__["prepare"] is orig_prep


# --------------------------------------------------------------------------------------------------------
# What a patch rests on; opt-in patches (ZB_PATCH_ENABLE); a patch that supersedes another
# --------------------------------------------------------------------------------------------------------

CONTRACT = R.RestsOn(R.NPU_CONTRACT, "a runtime behaviour no NPU run has shown")


def test_a_patch_must_say_what_it_rests_on(upstream):
    spec = dict(id="y", target="a:b", make=lambda o: o, fingerprints={"a": "b"}, why="", upstream=(), remove_when="")
    with pytest.raises(TypeError, match="rests_on"):
        Patch(**spec)
    with pytest.raises(ValueError, match="not one of host, one-stream, upstream, backport, npu-contract"):
        R.RestsOn("hope", "evidence")
    with pytest.raises(ValueError, match="evidence must be written out"):
        R.RestsOn(R.UPSTREAM, " ")
    assert not Patch(**spec, rests_on=RESTS).opt_in and Patch(**spec, rests_on=CONTRACT).opt_in


def test_an_npu_contract_patch_applies_only_when_enabled(upstream):
    mod = upstream.load()
    orig_step = mod.Runner.__dict__["step"]
    contract = _patch(upstream, "Runner.step", _double_step, pid="contract", rests_on=CONTRACT)
    plain = _patch(upstream, "Runner.prepare", lambda o: lambda self, n: [], pid="plain")
    ps = PatchSet("t", [plain, contract])
    rep = ps.apply()
    v = {i.id: (i.verdict, i.reason) for i in rep.items}
    assert v["plain"][0] == R.APPLIED
    assert v["contract"] == (
        R.OPT_IN,
        "opt-in, rests on an NPU contract no NPU run has shown: ZB_PATCH_ENABLE=contract applies it",
    )
    assert mod.Runner.__dict__["step"] is orig_step
    ps.unpatch()
    for enabled in ({"contract"}, {"*"}):
        rep = ps.apply(enabled=enabled)
        assert {i.id: i.verdict for i in rep.items} == {"plain": R.APPLIED, "contract": R.APPLIED}
        assert mod.Runner().step(1) == 20
        ps.unpatch()
    rep = ps.apply(disabled={"contract"}, enabled={"*"})  # disabling wins
    assert {i.id: i.verdict for i in rep.items} == {"plain": R.APPLIED, "contract": R.DISABLED}
    ps.unpatch()


def test_enabling_one_opt_in_patch_brings_its_group_and_the_opt_in_patches_it_requires(upstream):
    upstream.load()
    base = _patch(upstream, "Runner.pure", lambda o: o, pid="base", rests_on=CONTRACT)
    a = _patch(upstream, "Runner.step", _double_step, pid="a", group="g", requires=("base",), rests_on=CONTRACT)
    b = _patch(upstream, "Runner.prepare", lambda o: lambda self, n: [], pid="b", group="g", rests_on=CONTRACT)
    ps = PatchSet("t", [base, a, b])
    assert ps.opted_in({"b"}) == {"a": "b", "b": "b", "base": "b"}
    assert ps.opted_in({"base"}) == {"base": "base"}  # requiring is one direction only
    rep = ps.apply(enabled={"b"})
    assert set(rep.by_verdict(R.APPLIED)) == {"base", "a", "b"}
    ps.unpatch()
    rep = ps.apply(disabled={"base"}, enabled={"b"})  # the group comes along; without what it requires, a is not
    v = {i.id: (i.verdict, i.reason) for i in rep.items}
    assert v["base"][0] == R.DISABLED and v["b"][0] == R.APPLIED
    assert v["a"][0] == R.DISABLED and "needs base" in v["a"][1]
    ps.unpatch()


def test_an_enabled_patch_supersedes_the_default_of_the_same_target(upstream):
    mod = upstream.load()
    orig_step = mod.Runner.__dict__["step"]

    def _triple_step(orig):
        def step(self, x):
            return orig(self, x) * 3

        return step

    default = _patch(upstream, "Runner.step", _double_step, pid="default")
    variant = _patch(upstream, "Runner.step", _triple_step, pid="variant", supersedes=("default",), rests_on=CONTRACT)
    user = _patch(upstream, "Runner.prepare", lambda o: lambda self, n: [], pid="user", requires=("default",))
    ps = PatchSet("t", [default, variant, user])
    rep = ps.apply()
    assert {i.id: i.verdict for i in rep.items} == {"default": R.APPLIED, "variant": R.OPT_IN, "user": R.APPLIED}
    assert mod.Runner().step(1) == 20
    assert ps.unpatch() == ["default", "user"] and mod.Runner.__dict__["step"] is orig_step
    rep = ps.apply(enabled={"variant"})
    v = {i.id: (i.verdict, i.reason) for i in rep.items}
    assert v["default"] == (R.SUPERSEDED, "superseded by variant (ZB_PATCH_ENABLE), which replaces the same target")
    assert v["variant"][0] == R.APPLIED and v["user"][0] == R.APPLIED  # what requires the default is served by it
    assert mod.Runner().step(1) == 6  # the original (2) times 3, not times 10
    assert ps.unpatch() == ["variant", "user"] and mod.Runner.__dict__["step"] is orig_step


def test_two_patches_of_one_target_need_an_opt_in_supersession(upstream):
    upstream.load()
    a = _patch(upstream, "Runner.step", _double_step, pid="a")
    b = _patch(upstream, "Runner.step", _double_step, pid="b")
    with pytest.raises(ValueError, match="neither supersedes the other"):
        PatchSet("t", [a, b])
    c = _patch(upstream, "Runner.step", _double_step, pid="c", supersedes=("a",))
    with pytest.raises(ValueError, match="applied by default"):
        PatchSet("t", [a, c])
    d = _patch(upstream, "Runner.prepare", _double_step, pid="d", supersedes=("a",), rests_on=CONTRACT)
    with pytest.raises(ValueError, match="whose target is another"):
        PatchSet("t", [a, d])


def test_parts_put_each_engine_module_in_its_own_part_after_the_worker_part(upstream):
    """PatchSet.parts: the worker part (worker patches, guards, advisories), then one part per module of the engine
    patches, the engine guards with the first; a group spans parts through with_groups."""
    w = _patch(upstream, "Runner.step", _double_step, pid="w")
    e1 = _patch(upstream, "Runner.prepare", lambda o: o, pid="e1", roles=("engine",), group="g")
    e2 = _patch(upstream, "helper", lambda o: o, pid="e2", roles=("engine",), group="g")
    guard = R.Guard(upstream.target("Runner.pure"), {"test": "0" * 16})
    engine_guard = R.Guard(upstream.target("Runner.build"), {"test": "0" * 16}, roles=("engine",))
    ps = PatchSet("t", [w, e1, e2], [guard, engine_guard])
    worker, engine = ps.parts()
    assert [p.id for p in worker.patches] == ["w"] and worker.guards == (guard,) and worker.name == "t"
    assert [p.id for p in engine.patches] == ["e1", "e2"] and engine.guards == (engine_guard,)
    assert engine.name == f"t engine:{upstream.mod()}"
    assert ps.with_groups({"e1"}) == {"e1", "e2"} and ps.with_groups({"w"}) == {"w"}
    assert PatchSet("t", [w]).parts()[0].patches == (w,)


def test_a_patch_cannot_require_one_of_another_part(upstream):
    w = _patch(upstream, "Runner.step", _double_step, pid="w")
    e = _patch(upstream, "Runner.prepare", lambda o: o, pid="e", roles=("engine",), requires=("w",))
    with pytest.raises(ValueError, match="e names w, which is applied in another part"):
        PatchSet("t", [w, e])
