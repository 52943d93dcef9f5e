from benchmarks.rl.run import main

main()
