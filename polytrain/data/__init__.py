"""Data for many ranks: the resumable distributed sampler, sampler injection into a user's DataLoader,
where a resumed epoch starts, and equal evaluation batch counts for sharded strategies."""
