"""The plan panel: the pending plan in Terraform's text (``render_text``), coloured by action, with ``pdctl plan``'s
warning after it of ports held and GPUs used outside the deployment (``Plan.ports_held``, ``Plan.gpus_held``), or a note
that they could not be checked, and ``pdctl plan``'s notes (``service.Unsettled.notes``: an earlier apply that did not
finish, a role not serving as proven)."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from pdctl.statemachine.plan import Plan, render_text

__all__ = ["PlanPanel", "render_plan"]


def render_plan(plan: Plan | None, *, error: str | None = None, ports_unchecked: str | None = None,
                notes: tuple[str, ...] = ()) -> Text:
    """*plan* as ``pdctl plan`` prints it, each line coloured by what it does; *ports_unchecked*: why the ports it will
    listen on could not be checked (``Plan.ports_held`` is None); *notes*: ``pdctl plan``'s other notes
    (``service.Unsettled.notes``). Both are said after the plan, each as ``note: …``, as ``pdctl plan`` says them on
    stderr."""
    if error:
        return Text(f"The spec cannot be planned: {error}", style="bold red")
    if plan is None:
        return Text("no plan yet (r reloads the spec)", style="dim")
    out = Text()
    for i, line in enumerate(render_text(plan).splitlines()):
        s = line.lstrip()
        style = ""
        if s.startswith("-/+") or s.startswith("- "):
            style = "bold red"
        elif s.startswith("+"):
            style = "green"
        elif s.startswith("~"):
            style = "yellow"
        elif s.startswith("!"):
            style = "bold red"
        elif s.startswith("Warning:"):
            style = "bold yellow"
        elif s.startswith("#"):
            style = "dim"
        elif s.startswith("Plan:") or s.startswith("No changes"):
            style = "bold"
        if i:
            out.append("\n")
        out.append(line, style=style)
    for note in (*notes, *([ports_unchecked] if ports_unchecked else [])):
        out.append(f"\n\nnote: {note}", style="yellow")
    return out


class PlanPanel(Widget):
    """The plan from what is deployed to what the (re)loaded spec asks."""

    DEFAULT_CSS = """
    PlanPanel {
        height: auto;
        padding: 0 1;
    }
    """

    plan: reactive[Plan | None] = reactive(None, layout=True)
    """The plan shown (None: not planned yet)."""
    error: reactive[str | None] = reactive(None, layout=True)
    """Why the spec could not be loaded or planned."""
    ports_unchecked: reactive[str | None] = reactive(None, layout=True)
    """Why the ports the plan's deployment will listen on could not be checked (the host or its service manager
    could not be asked); None when they were (the plan's ``ports_held`` then says what holds them)."""
    notes: reactive[tuple[str, ...]] = reactive((), layout=True)
    """``pdctl plan``'s notes beside the plan (``service.Unsettled.notes``), without the ``note:`` prefix."""
    spec_changed: reactive[bool] = reactive(False, layout=True)
    """The spec file changed on disk since it was last read: the plan shown may not be what applying it does."""
    last_failure: reactive[str | None] = reactive(None, layout=True)
    """Why the console's last apply failed or was refused, in full (its toast goes after 15 s, the header cuts
    it); shown above the plan until the next apply starts."""

    def render(self) -> Text:
        plan = render_plan(self.plan, error=self.error, ports_unchecked=self.ports_unchecked, notes=self.notes)
        if self.spec_changed:
            plan = Text.assemble(("The spec file changed on disk since this plan was made: r reloads it and plans "
                                  "again (a applies the plan shown here, as it was read).", "bold yellow"), "\n\n",
                                 plan)
        if not self.last_failure:
            return plan
        return Text.assemble((self.last_failure, "bold red"), "\n\n", plan)
