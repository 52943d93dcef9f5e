from benchmarks.rl.run import main

if __name__ == "__main__":  # importing the package's __main__ must not run the benchmark
    main()
