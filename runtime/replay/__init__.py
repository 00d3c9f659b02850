"""``python -m runtime.replay``: replay the structured log of a run, round by round.

Without any model: read the log (``reading``), rebuild every request's output and audit
each round against the decode-loop invariants (``audit``), summarise acceptance and
timings (``summary``), and draw the rounds as a Chrome/Perfetto trace (``trace``). With
``--rerun`` (``rerun``): load the models the log names, run each request again and name
the first round that differs.
"""
