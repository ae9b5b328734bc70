"""The data sources: one module per `data=` option, holding its check and its build.

conf/data/<option>.yaml names its module with the key `module` (runner.data.arrays, ...): the
conf dir is the registry. A source module has
- `KINDS`: what it can feed, ("image", "tokens") or one of them;
- `check(d, request)`: its keys and files checked, ConfigError (one line) for a bad value;
  TensorFlow-free, so that bad input is answered before TensorFlow loads: the module's top
  level imports neither TensorFlow nor numpy (runner.launch composes and checks configs in a
  process that must stay single-threaded, and numpy's OpenBLAS starts threads);
- `build(d, request) -> Examples` (runner/data/examples.py): the raw examples, the map that
  prepares one, the DataSpec. TensorFlow is imported inside the build side's functions.
Optional: `from_files(d, request) -> dict`, the keys `d` leaves null that the source's files
say (arrays: data.seq_len, data.image_size; tfrecord: data.num_classes), which the config then
carries (runner/config/data.py); `errors(d)`, a context manager turning an error found only
as the pipeline is drawn into one line.
`d` is the job's `data` config; what the source needs of the rest of the job comes in a
`Request` (runner/data/contract.py). runner/feed/pipelines.py makes the pipelines of it.
"""
