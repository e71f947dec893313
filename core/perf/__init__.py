"""What the server and the benchmarks both compute about performance: the devices' peaks, what a step computes
and moves (the roofline), the floors of a model's matmuls, and the doctor's readings and checklist."""
