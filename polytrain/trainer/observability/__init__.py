"""The trainer's observability: what a run reports about itself: self.log's metrics, the profilers,
goodput."""
