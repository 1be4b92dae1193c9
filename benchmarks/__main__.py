"""`make bench`: run every benchmark in turn."""

from benchmarks import bench_trainer

if __name__ == "__main__":
    bench_trainer.main()
