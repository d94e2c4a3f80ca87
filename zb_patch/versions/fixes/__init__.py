"""The fixes of upstream defects, one module per fix (its wrappers and the factory of its specs; each spec says
why / how / upstream / remove-when). An adapter declares a fix by calling the module's factory with the fingerprints
of its release (``module.patch(...)``, or ``module.patches(...)`` for a fix of several patches).

These are *fixes*, not zero-bubble: each applies whenever its defect can bite (speculative decoding on, with async
scheduling where the defect needs it, whatever zero-bubble decides for the runner), and each is its own patch id (or
group), so ``ZB_PATCH=1 ZB_PATCH_DISABLE=<the zero-bubble patches>`` gives the release's classic async path with
only the fixes.

A fix is worker-side (the runner's) or scheduler-side (role ``engine``: its own part of the set, ``PatchSet.parts``),
never both: the scheduler (EngineCore process) and the runner (worker processes, with the multiprocess or Ray
executors) need not share a process, and each part applies where its modules are imported.

Nothing heavy is imported at module level: torch only inside the functions a patched method calls. The modules
import from ``zb_patch.registry`` only (never from ``zb_patch.versions`` or an adapter). Reference, generated from the
specs: docs/releases/<adapter>.md and docs/releases/shared-fixes.md (``zb-patch patches`` prints every field); the
long forms the specs name: docs/e2e.md ("Release defects"), docs/graph-modes.md, docs/results.md (figures).
"""
