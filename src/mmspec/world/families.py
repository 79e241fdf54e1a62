"""The eight image families of the world (:data:`FAMILIES`, name -> :class:`~mmspec.world.core.Family`),
in one module below both ``mmspec.world`` (which re-exports them) and :mod:`.conversation` (whose
turns are drawn from three of them), so neither imports the other.
"""

from __future__ import annotations

from mmspec.world import pairs, single, stories
from mmspec.world.core import Family

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("chartqa", 1, single.draw_chart, single.render_chart, "bar chart questions: max/min/value/colour/difference"),
        Family("textvqa", 1, single.draw_sign, single.render_sign, "read the word / number / colour of a sign"),
        Family("vqav2", 1, single.draw_vqa, single.render_vqa, "colour, count, position and shape of flat shapes"),
        Family("hallusionbench", 1, single.draw_hallu, single.render_hallu, "yes/no: is a thing there; is a count right"),
        Family("spot_the_diff", 2, pairs.draw_diff, pairs.render_diff, "one or two changes between two scenes"),
        Family("iedit", 2, pairs.draw_edit, pairs.render_edit, "an edit instruction from source to target"),
        Family("pororosv", 5, stories.draw_pororo, stories.render_pororo, "cartoon: a character walks to a landmark"),
        Family("vist", 5, stories.draw_vist, stories.render_vist, "photo album: a trip ending at a place and time"),
    )
}
N_IMAGES: dict[str, int] = {name: f.n_images for name, f in FAMILIES.items()}
