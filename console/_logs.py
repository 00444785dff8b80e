"""The logs panel: the selected role's recent lines (journal or supervisor log file, through the
service manager), following as new lines arrive. ``[`` / ``]`` pick the role."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Log, Static

from pdctl.console.views import new_lines

__all__ = ["LogsPanel"]


class LogsPanel(Vertical):
    """One role's log tail, following."""

    BINDINGS = [
        Binding("left_square_bracket", "cycle(-1)", "Prev role", show=False),
        Binding("right_square_bracket", "cycle(1)", "Next role", show=False),
    ]
    """
    | Key(s) | Description |
    | :- | :- |
    | [ | Show the previous role's log. |
    | ] | Show the next role's log. |
    """

    DEFAULT_CSS = """
    LogsPanel {
        height: 1fr;
        & > #logs-head { height: 1; padding: 0 1; color: $text-muted; }
        & > Log { height: 1fr; border: none; }
    }
    """

    roles: reactive[tuple[str, ...]] = reactive(())
    """Roles that have logs (servers, then the router)."""
    role: reactive[str | None] = reactive(None)
    """The role whose log is shown."""

    class RoleChanged(Message):
        """The shown role changed. Handler: ``on_logs_panel_role_changed``."""

        def __init__(self, panel: LogsPanel, role: str | None) -> None:
            super().__init__()
            self.panel = panel
            self.role = role

        @property
        def control(self) -> LogsPanel:
            return self.panel

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None, disabled: bool = False) -> None:
        super().__init__(name=name, id=id, classes=classes, disabled=disabled)
        self._shown: tuple[str, ...] = ()
        self._shown_role: str | None = None

    def compose(self) -> ComposeResult:
        yield Static("", id="logs-head")
        yield Log(max_lines=2000, auto_scroll=True)

    def _head(self) -> str:
        names = "  ".join(f"[b reverse] {r} [/]" if r == self.role else f" {r} " for r in self.roles)
        return f"{names}   [dim]\\[ ] switch role · following[/]"

    def watch_roles(self, roles: tuple[str, ...]) -> None:
        if self.role not in roles:
            self.role = roles[0] if roles else None
        self._update_head()

    def watch_role(self, role: str | None) -> None:
        self._update_head()
        self.post_message(self.RoleChanged(self, role))

    def _update_head(self) -> None:
        if self.is_mounted:
            self.query_one("#logs-head", Static).update(self._head())

    def on_mount(self) -> None:
        self._update_head()

    def action_cycle(self, delta: int) -> None:
        if not self.roles:
            return
        i = self.roles.index(self.role) if self.role in self.roles else 0
        self.role = self.roles[(i + delta) % len(self.roles)]

    def show(self, role: str | None, lines: tuple[str, ...]) -> LogsPanel:
        """Show *lines* (the tail of *role*'s log), appending only what is new."""
        log = self.query_one(Log)
        if role != self._shown_role:
            log.clear()
            self._shown = ()
            self._shown_role = role
        add, reset = new_lines(self._shown, lines)
        if reset:
            log.clear()
        if add:
            log.write_lines(add)
        self._shown = lines
        return self
