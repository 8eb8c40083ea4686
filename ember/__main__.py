from ember.cli import main

main()
