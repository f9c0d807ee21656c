"""What changed between two ticks that a time plot marks: a backend's live cap or ceiling, its
health, the router's policy, each as a short text ("cpu0 live cap 4→8", "policy → cache-aware",
"cpu1 down"). Qt-free, so it tests without a screen; `ui.panels.plot_marks` draws the marks.
Plain data: its owner (a view, on the GUI thread) is the only one touching it.
"""

from __future__ import annotations


class ChangeTracker:
    """Remembers the last tick's caps, health and policy; `update` says what changed since."""

    def __init__(self) -> None:
        self._backends: dict[str, tuple[int, int, bool]] | None = None
        self._policy: str | None = None

    def update(self, snapshots, policy: str) -> list[str]:
        now = {s.name: (s.cap, s.cap_ceiling or s.cap, s.healthy) for s in snapshots}
        changes: list[str] = []
        if self._backends is not None:
            for name, (cap, ceiling, healthy) in now.items():
                old = self._backends.get(name)
                if old is None:
                    continue
                if ceiling != old[1]:
                    changes.append(f"{name} ceiling {old[1]}→{ceiling}")
                if cap != old[0]:
                    changes.append(f"{name} live cap {old[0]}→{cap}")
                if healthy != old[2]:
                    changes.append(f"{name} {'healthy again' if healthy else 'down'}")
        if self._policy is not None and policy != self._policy:
            changes.append(f"policy → {policy}")
        self._backends, self._policy = now, policy
        return changes


def is_engines_own(change: str) -> bool:
    """A change the engine made by itself (an adaptive cap moving), not one a person made (a
    ceiling, the policy) nor a backend's health: its line stays, dotted, unlabelled (the
    tooltip says it), so the labels a class reads are the moments a control acted."""
    return " live cap " in f" {change}"
