"""The trainer's api: what users write against and the funnel that calls it: TrainModule, DataModule,
hyperparameters, the data hooks, configure_optimizers' returns, the hook funnel."""
