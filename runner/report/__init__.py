"""What a run and a sweep leave behind: the run's figures under their fixed keys (figures), the
end-of-run summary (summary), pruning's figures (pruning), the per-layer profile's files
(layer_report, layer_plots), the memory timeline (timeline), a sweep's comparison pictures
(sweep_plots), all drawn in one plotting style (plots)."""
