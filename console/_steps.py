"""The state-machine panel: the six steps (four for a single server), status, proof summary and
elapsed time. Enter on a step posts :class:`StepsPanel.StepSelected`; the app shows its proof."""

from __future__ import annotations

from rich.text import Text
from textual.binding import Binding
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget

from pdctl.console.views import StepView, fmt_duration

__all__ = ["STATUS_MARK", "StepsPanel", "render_steps"]

STATUS_MARK = {
    "pending": ("·", "dim"),
    "running": ("▶", "bold yellow"),
    "done": ("✓", "bold green"),
    "skipped": ("=", "green"),
    "failed": ("✗", "bold red"),
    "interrupted": ("‖", "bold yellow"),
}
"""Status → (mark, style)."""


def render_steps(steps: tuple[StepView, ...], cursor: int | None, width: int) -> Text:
    """One line per step: mark, name, status, elapsed, summary (cut to *width*)."""
    out = Text(no_wrap=True, overflow="ellipsis")
    status_w = max([8, *(len(s.status) for s in steps)])  # "interrupted" widens the column, aligned
    for i, s in enumerate(steps):
        mark, style = STATUS_MARK.get(s.status, ("?", "magenta"))
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(f"{'›' if i == cursor else ' '}{mark} ", style=style)
        line.append(f"{s.name:<19}", style="bold" if i == cursor else "")
        line.append(f"{s.status:<{status_w}}", style=style)
        line.append(f"{fmt_duration(s.elapsed_s):>7}  ", style="cyan")
        summary = s.summary if s.status != "failed" else (s.error or s.summary)
        line.append(summary or "", style="red" if s.status == "failed" else "")
        line.truncate(max(1, width), overflow="ellipsis")
        if i == cursor:
            line.stylize("reverse")
        out.append_text(line)
        if i < len(steps) - 1:
            out.append("\n")
    return out


class StepsPanel(Widget, can_focus=True):
    """The state machine's steps and their last proofs."""

    BINDINGS = [
        Binding("up,k", "cursor(-1)", "Up", show=False),
        Binding("down,j", "cursor(1)", "Down", show=False),
        Binding("enter", "select", "Proof", show=False),
    ]
    """
    | Key(s) | Description |
    | :- | :- |
    | up, k | Previous step. |
    | down, j | Next step. |
    | enter | Show the step's full proof and commands. |
    """

    DEFAULT_CSS = """
    StepsPanel {
        height: auto;
        border: round $primary-darken-2;
        border-title-color: $text;
        padding: 0 1;
        &:focus { border: round $accent; }
    }
    """

    steps: reactive[tuple[StepView, ...]] = reactive((), layout=True)
    """The rows, first step first."""
    cursor: reactive[int] = reactive(0)
    """Index of the highlighted step."""

    class StepSelected(Message):
        """A step was chosen (Enter or click). Handler: ``on_steps_panel_step_selected``."""

        def __init__(self, panel: StepsPanel, step: StepView) -> None:
            super().__init__()
            self.panel = panel
            self.step = step

        @property
        def control(self) -> StepsPanel:
            return self.panel

    def __init__(self, steps: tuple[StepView, ...] = (), *, name: str | None = None, id: str | None = None, classes: str | None = None, disabled: bool = False) -> None:
        super().__init__(name=name, id=id, classes=classes, disabled=disabled)
        self.border_title = "State machine"
        self.set_reactive(StepsPanel.steps, steps)

    def render(self) -> Text:
        return render_steps(self.steps, self.cursor if self.has_focus else None, self.content_size.width)

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()

    def validate_cursor(self, value: int) -> int:
        return max(0, min(value, len(self.steps) - 1)) if self.steps else 0

    @property
    def selected(self) -> StepView | None:
        return self.steps[self.cursor] if self.steps else None

    def action_cursor(self, delta: int) -> None:
        self.cursor += delta

    def action_select(self) -> None:
        if self.selected is not None:
            self.post_message(self.StepSelected(self, self.selected))

    def on_click(self, event) -> None:  # noqa: ANN001
        row = event.y - 1 if event.y is not None else -1  # border row
        if 0 <= row < len(self.steps):
            self.cursor = row
            self.action_select()
