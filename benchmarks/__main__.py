"""`make bench`: run every benchmark in turn, each printing its own ratio."""

from benchmarks import (
    bench_cache,
    bench_checkpoint,
    bench_compute,
    bench_data_parallel,
    bench_dataloader,
    bench_ddp,
    bench_fsdp,
    bench_gpt,
    bench_heap,
    bench_huggingface,
    bench_images,
    bench_onnx,
    bench_overhead,
    bench_pipeline,
    bench_quantize,
    bench_registration,
    bench_search,
    bench_serving,
    bench_streaming,
    bench_text,
    bench_trainer,
    bench_validation,
)

if __name__ == "__main__":
    for bench in (
        bench_trainer,
        bench_compute,
        bench_ddp,
        bench_data_parallel,
        bench_fsdp,
        bench_pipeline,
        bench_dataloader,
        bench_validation,
        bench_streaming,
        bench_cache,
        bench_overhead,
        bench_registration,
        bench_heap,
        bench_quantize,
        bench_onnx,
        bench_serving,
        bench_checkpoint,
        bench_images,
        bench_text,
        bench_gpt,
        bench_huggingface,
        bench_search,
    ):
        bench.main()
        print()
