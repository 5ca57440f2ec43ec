"""TensorFlow distributed-training plugin built on rdmatensor."""
