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


class FollowingLog(Log):
    """A :class:`~textual.widgets.Log` that keeps following its newest line until the operator scrolls back (a key
    or the mouse wheel up, dragging the scroll bar), and again once they scroll to the end. Textual's own
    ``auto_scroll`` follows only while the view is at the end, so a terminal resize that left the view mid-way
    stopped it for good while the panel still said "following"."""

    following: reactive[bool] = reactive(True)
    """Whether new lines scroll the view to the end."""

    def _back(self) -> None:
        # scrolled towards the start: stop following at once (a later check of the position could still find the
        # view at the end, before an animated scroll moved it, and the next line would take it back there)
        if self.max_scroll_y > 0:
            self.following = False

    def _scrolled(self) -> None:
        # scrolled towards the end, or dragged: following again once the view is there
        self.call_after_refresh(lambda: setattr(self, "following", self.is_vertical_scroll_end))

    def action_scroll_up(self) -> None:
        self._back()
        super().action_scroll_up()

    def action_page_up(self) -> None:
        self._back()
        super().action_page_up()

    def action_scroll_home(self) -> None:
        self._back()
        super().action_scroll_home()

    def action_scroll_down(self) -> None:
        super().action_scroll_down()
        self._scrolled()

    def action_page_down(self) -> None:
        super().action_page_down()
        self._scrolled()

    def action_scroll_end(self) -> None:
        super().action_scroll_end()
        self.following = True

    # (Textual calls the handler of each class in the MRO, so these run beside Widget's own, not instead of it)
    def _on_mouse_scroll_up(self, event) -> None:  # noqa: ANN001
        self._back()

    def _on_mouse_scroll_down(self, event) -> None:  # noqa: ANN001
        self._scrolled()

    def _on_scroll_to(self, message) -> None:  # noqa: ANN001  (the scroll bar dragged)
        self._scrolled()

    def _on_scroll_up(self, message) -> None:  # noqa: ANN001  (a click on the scroll bar's track, above it)
        self._back()

    def _on_scroll_down(self, message) -> None:  # noqa: ANN001
        self._scrolled()

    def follow(self) -> None:
        """Scroll to the newest line when following and not there (after a resize, a clear, new lines)."""
        if self.following and not self.is_vertical_scroll_end:
            self.scroll_end(animate=False, immediate=True, x_axis=False)

    def _on_resize(self, event) -> None:  # noqa: ANN001
        self.call_after_refresh(self.follow)


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
        yield FollowingLog(max_lines=2000, auto_scroll=False)

    def _head(self) -> str:
        names = "  ".join(f"[b reverse] {r} [/]" if r == self.role else f" {r} " for r in self.roles)
        following = self.query_one(FollowingLog).following if self.is_mounted else True
        state = "following" if following else "[b]scrolled back[/b]: End to follow"
        return f"{names}   [dim]\\[ ] switch role · {state}[/]"

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
        self.watch(self.query_one(FollowingLog), "following", lambda _following: self._update_head(), init=False)
        self._update_head()

    def action_cycle(self, delta: int) -> None:
        if not self.roles:
            return
        i = self.roles.index(self.role) if self.role in self.roles else 0
        self.role = self.roles[(i + delta) % len(self.roles)]

    def show(self, role: str | None, lines: tuple[str, ...]) -> LogsPanel:
        """Show *lines* (the tail of *role*'s log), appending only what is new; the view follows the newest line
        unless the operator scrolled back (another role's log starts following again)."""
        log = self.query_one(FollowingLog)
        if role != self._shown_role:
            log.clear()
            log.following = True
            self._shown = ()
            self._shown_role = role
        add, reset = new_lines(self._shown, lines)
        if reset:
            log.clear()
        if add:
            log.write_lines(add, scroll_end=log.following)
        log.follow()
        self._shown = lines
        return self
