pub mod tiny_checkpoint;
