"""Floor 3, the simulation: a traced timeline turned into every rank's peak. The layer graph, the expansion to
full depth (`timeline`), the strategies that partition it (`strategies/`), the peak replay (`peaks`), the
caching-allocator model and its replays (`allocator`, `replay`), the lower bound `size` prunes with, and
`pipeline`, which strings these together. Imports the model and inputs floors, never measurement or the app."""
