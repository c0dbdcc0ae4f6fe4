"""Record and replay: many small records of one state, for analysis and re-runs, in an
append-only format of its own."""
