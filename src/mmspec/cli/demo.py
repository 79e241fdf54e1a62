"""``mmspec demo``: every drafting method on a few synthetic-world samples with the embedded models."""

from __future__ import annotations

import statistics

import typer
from rich.markup import escape
from rich.table import Table

from mmspec.cli import common, options
from mmspec.cli.common import fail, names
from mmspec.cli.generate import EMBEDDED_NOTE, baseline, load_models
from mmspec.errors import MMSpecError

DEMO_METHODS = "M,T,C,P,MT,MTC,MTCP,M+tree"


def demo(
    methods: str = options.methods(DEMO_METHODS),
    families: str = typer.Option("chartqa,textvqa,spot_the_diff,pororosv", help="World families (1, 2 and 5 images)."),
    max_new_tokens: int = options.max_new_tokens(64, "sample"),
    gamma: int = typer.Option(5),
    repeats: int = typer.Option(3, help="Runs of the target alone and of each method per family, interleaved; "
                                "the speed-up is the ratio of their medians."),
    threads: int | None = options.THREADS,
    head: list[str] | None = options.heads("--methods M,eagle,eagle+tree --head eagle=DIR"),
):
    """Run every drafting method on a few synthetic-world samples with the embedded models.

    Prints, per method, whether the output is identical to the target's, the block efficiency
    and the speed-up over the target alone (medians of `--repeats` interleaved runs)."""
    try:
        from mmspec.bench.config import parse_method, split_methods
        from mmspec.cli.bench import _parse_heads
        from mmspec.cli.checks import check_demo
        from mmspec.inputs import processor_inputs
        from mmspec.world import make_sample

        fams, meths = names(families), list(split_methods([methods]))
        heads = dict(_parse_heads(head))
        check_demo(meths, fams, max_new_tokens, gamma, repeats, threads, heads)  # every option before any model runs
        common.set_threads(threads, say=True)
        t, d, tok, proc, cap, _ = load_models(None, None, None, None, "auto", "cpu")
        common.console.print(EMBEDDED_NOTE)
        decs = {m: _decoder(m, t, d, tok, proc, cap, gamma, heads) for m in meths}
        tab = Table(title=f"mmspec demo (embedded models, CPU, gamma={gamma}, greedy, {max_new_tokens} new tokens)")
        for col in ["family", "images", "method", "tau", "accepted len", f"speed-up (median of {repeats})", "identical"]:
            tab.add_column(col)
        mismatches = []
        for fam in fams:
            s = make_sample(fam, "test", 0)
            inputs = processor_inputs(proc, s.prompt, s.images)
            base_s: list[float] = []
            runs: dict[str, list] = {m: [] for m in decs}
            for _ in range(repeats):  # interleaved: a burst of load hits the target and the methods alike
                ref, secs = baseline(t, inputs, max_new_tokens)
                base_s.append(secs)
                for m, dec in decs.items():
                    runs[m].append(dec.generate(inputs["input_ids"], inputs.get("pixel_values"),
                                                inputs.get("attention_mask"), max_new_tokens=max_new_tokens,
                                                images=s.images))
            common.console.print(f"[bold]{fam}[/bold] — {escape(s.question or s.prompt[:80])}\n"
                          f"  target: {escape(tok.decode(ref, skip_special_tokens=True))}")
            for m, results in runs.items():
                st = results[0].stats
                same = all(r.token_ids == ref for r in results)
                lossy = parse_method(m)[1].get("acceptance") == "relaxed"  # +relaxed: lossy by design
                if not same and not lossy:
                    mismatches.append(f"{fam}/{m}")
                speedup = statistics.median(base_s) / statistics.median(r.stats.total_s for r in results)
                tab.add_row(fam, str(len(s.images)), m, f"{st.tau:.2f}", f"{st.mean_accepted_length:.2f}",
                            f"{speedup:.2f}x", "[green]yes[/green]" if same else ("no (relaxed: lossy)" if lossy else "[red]NO[/red]"))
        common.console.print(tab)
        common.console.print(f"[dim]tau = tokens per block incl. the bonus/recovered token; speed-up = median time of the "
                      f"target alone / median time of the method over {repeats} interleaved run(s) of one sample "
                      "on this machine: other load on it moves the figure (see `mmspec bench` for medians over "
                      "100 samples).[/dim]")
        if mismatches:
            raise MMSpecError(f"output differs from target.generate for {', '.join(mismatches)}; "
                              "greedy speculative decoding must be exact, please report this")
    except MMSpecError as e:
        fail(e)


def _decoder(method: str, target, draft, tok, proc, captioner, gamma: int, heads: dict):
    """The SpecDecoder of one demo method: the pack's draft with the method's views, or a head."""
    from mmspec.bench.config import parse_method
    from mmspec.decoder import SpecDecoder
    from mmspec.drafting.tree import reads_gamma

    views, kw = parse_method(method)
    if reads_gamma(kw.get("tree")):  # --gamma: the chains' length; a tree method has its own shape
        kw["gamma"] = gamma
    variant = kw.pop("head", None)
    if variant is not None:
        return SpecDecoder(target, heads[variant], tok, processor=proc, **kw)
    alone = kw.pop("draft", None)  # lookup / suffix alone: no draft model, no captioner
    return SpecDecoder(target, alone or draft, tok, views=views or ("M",), captioner=None if alone else captioner,
                       processor=proc, **kw)
