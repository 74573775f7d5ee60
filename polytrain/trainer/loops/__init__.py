"""The trainer's loops: the fit and evaluation loops: a stage's set-up and tear-down (lifecycle), the fit
(fit_loop), one batch's optimisation, evaluation passes, when validation runs, loop state, the run's
guards, where loaders come from."""
