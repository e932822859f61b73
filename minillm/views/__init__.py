"""Views: a run shown to a person. Each reads a record (a Trace, a serving run's steps) and
draws it; the engine never imports a view to do its work.

    terminal.py          a trace as rich panels and tables (``minillm generate --trace``)
    html.py              a trace as HTML for notebooks: ``trace_html(trace)``, ``show(trace)``
    chrome_trace.py      a trace on a Perfetto timeline (``write_trace``; the format: formats/trace_events.py)
    plots.py             timeline, roofline, KV cache bytes, sweep plots (matplotlib)
    serving_terminal.py  the serving engine's steps, KV pool and requests as rich tables
    serving_plots.py     a serving run's timeline, rate sweeps and inter-token latencies (matplotlib)
"""
