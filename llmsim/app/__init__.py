"""Floor 5, the application: the command line (`options` builds and reads its arguments without importing torch,
`cli` runs the commands), and what is built on predictions: `size`, `sweep`, `compare`, `report`, `plots`."""
